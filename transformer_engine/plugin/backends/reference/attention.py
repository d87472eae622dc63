"""Reference (pure PyTorch) implementations: attention ops. See plugin/catalog/attention.py for the math."""

__all__ = []
