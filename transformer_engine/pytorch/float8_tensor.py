"""Legacy import path of :class:`Float8Tensor` (TE keeps it): use ``transformer_engine.pytorch.tensor``."""

from .tensor.float8_tensor import Float8Tensor

__all__ = ["Float8Tensor"]
