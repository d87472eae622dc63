"""Reference (pure PyTorch) implementations: softmax ops. See plugin/catalog/softmax.py for the math."""

__all__ = []
