"""Reference (pure PyTorch) implementations: gemm ops. See plugin/catalog/gemm.py for the math."""

__all__ = []
