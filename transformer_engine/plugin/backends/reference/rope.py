"""Reference (pure PyTorch) implementations: rope ops. See plugin/catalog/rope.py for the math."""

__all__ = []
