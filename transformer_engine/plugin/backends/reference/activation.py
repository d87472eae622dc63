"""Reference (pure PyTorch) implementations: activation ops. See plugin/catalog/activation.py for the math."""

__all__ = []
