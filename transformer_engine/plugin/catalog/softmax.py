"""The fused softmax family of Megatron-style attention (scores [b, h, sq, sk] or [b*h, sq, sk]).

Every forward computes y = softmax(scale * x + m, dim=-1) in float32 and returns y in x's dtype;
every backward computes dx = scale * y * (dy - sum(dy * y, dim=-1)) from the saved output y.
m is 0 (scaled), -10000 where ``mask`` is true (masked; mask [b or 1, 1, sq, sk], True = masked out),
or -inf above the diagonal (upper-triangular, top-left aligned; aligned-causal is bottom-right
aligned: position j is masked for row i when j > i + sk - sq). Fully masked rows give zeros.

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available): empty tensors (a zero batch) give
empty results; x must be float32 / bfloat16 /
float16 (TypeError otherwise) with the stated number of dims (ValueError); a NaN or +inf score
makes its whole row NaN (as torch.softmax: no NaN is hidden); inputs may have any strides.
"""

from __future__ import annotations

from transformer_engine.plugin.core.catalog import Tensor, declare


@declare
def scaled_softmax_forward(x: Tensor, scale: float) -> Tensor:
    """y = softmax(scale * x)."""


@declare
def scaled_softmax_backward(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    """dx = scale * y * (dy - sum(dy * y))."""


@declare
def scaled_masked_softmax_forward(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    """y = softmax(scale * x - 10000 * mask)."""


@declare
def scaled_masked_softmax_backward(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    """dx = scale * y * (dy - sum(dy * y))."""


@declare
def scaled_upper_triang_masked_softmax_forward(x: Tensor, scale: float) -> Tensor:
    """y = softmax(scale * x with x[.., i, j > i] = -inf); x is [b*h, sq, sk]."""


@declare
def scaled_upper_triang_masked_softmax_backward(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    """dx = scale * y * (dy - sum(dy * y))."""


@declare
def scaled_aligned_causal_masked_softmax_forward(x: Tensor, scale: float) -> Tensor:
    """y = softmax(scale * x with x[.., i, j > i + sk - sq] = -inf); x is [b, h, sq, sk]."""


@declare
def scaled_aligned_causal_masked_softmax_backward(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    """dx = scale * y * (dy - sum(dy * y))."""
