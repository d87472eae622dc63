"""Reference (pure PyTorch) implementations: normalization ops. See plugin/catalog/normalization.py for the math."""

__all__ = []
