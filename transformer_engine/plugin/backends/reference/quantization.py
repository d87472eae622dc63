"""Reference (pure PyTorch) implementations: quantization ops. See plugin/catalog/quantization.py for the math."""

__all__ = []
