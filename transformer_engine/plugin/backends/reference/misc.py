"""Reference (pure PyTorch) implementations: misc ops. See plugin/catalog/misc.py for the math."""

__all__ = []
