"""Reference (pure PyTorch) implementations: optimizer ops. See plugin/catalog/optimizer.py for the math."""

__all__ = []
