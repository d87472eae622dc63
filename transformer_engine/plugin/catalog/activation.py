"""Activations and gated activations (TE's list), forward and backward, plus the fused FP8 form.

Gated ("GLU") ops take x = [a, b] split in halves along the last dim (2F -> F):
y = act(a) * b, and their backward returns dx = [dy * b * act'(a), dy * act(a)] of x's shape.
Plain ops are elementwise and return y of x's shape; their backward is dx = dy * act'(x).
All math runs in float32 and is cast back to x's dtype.

gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (tanh approximation, as TE)
qgelu(x) = x * sigmoid(1.702 x); silu(x) = x * sigmoid(x); relu(x) = max(x, 0);
srelu(x) = relu(x)^2; glu uses sigmoid; swiglu uses silu; geglu gelu; qgeglu qgelu; reglu relu;
sreglu srelu. clamped_swiglu (GPT-OSS): a' = min(a, limit), b' = clip(b, -limit, limit),
y = a' * sigmoid(alpha * a') * (b' + 1); gradients through a clamp are zero where it clamps.

Edge cases (every backend; tests/plugin/test_op_contracts.py checks each on every backend available):
- empty tensors and zero-size dims are fine and give empty results of the declared shape;
- a gated op whose last dim is odd raises ValueError; an unknown ``activation`` name raises ValueError;
- NaN and +-inf propagate as the formula in float32 gives them (inf - inf, 0 * inf -> NaN); the
  clamps of clamped_swiglu keep NaN (NaN in, NaN out) and zero the gradient there;
- inputs may have any strides; outputs are new contiguous tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformer_engine.plugin.core.catalog import Tensor, declare, dtype


@declare
def gelu(x: Tensor) -> Tensor:
    """y = gelu_tanh(x)."""


@declare
def dgelu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = dy * gelu_tanh'(x)."""


@declare
def qgelu(x: Tensor) -> Tensor:
    """y = x * sigmoid(1.702 x)."""


@declare
def dqgelu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = dy * (s + 1.702 x s (1 - s)), s = sigmoid(1.702 x)."""


@declare
def relu(x: Tensor) -> Tensor:
    """y = max(x, 0)."""


@declare
def drelu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = dy * [x > 0]."""


@declare
def srelu(x: Tensor) -> Tensor:
    """y = max(x, 0)^2."""


@declare
def dsrelu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = dy * 2 max(x, 0)."""


@declare
def silu(x: Tensor) -> Tensor:
    """y = x * sigmoid(x)."""


@declare
def dsilu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = dy * (s + x s (1 - s)), s = sigmoid(x)."""


@declare
def glu(x: Tensor) -> Tensor:
    """y = sigmoid(a) * b."""


@declare
def dglu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = [dy * b * s (1 - s), dy * s], s = sigmoid(a)."""


@declare
def geglu(x: Tensor) -> Tensor:
    """y = gelu_tanh(a) * b."""


@declare
def dgeglu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = [dy * b * gelu_tanh'(a), dy * gelu_tanh(a)]."""


@declare
def qgeglu(x: Tensor) -> Tensor:
    """y = qgelu(a) * b."""


@declare
def dqgeglu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = [dy * b * qgelu'(a), dy * qgelu(a)]."""


@declare
def reglu(x: Tensor) -> Tensor:
    """y = relu(a) * b."""


@declare
def dreglu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = [dy * b * [a > 0], dy * relu(a)]."""


@declare
def sreglu(x: Tensor) -> Tensor:
    """y = relu(a)^2 * b."""


@declare
def dsreglu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = [dy * b * 2 relu(a), dy * relu(a)^2]."""


@declare
def swiglu(x: Tensor) -> Tensor:
    """y = silu(a) * b."""


@declare
def dswiglu(dy: Tensor, x: Tensor) -> Tensor:
    """dx = [dy * b * silu'(a), dy * silu(a)]."""


@declare
def clamped_swiglu(x: Tensor, limit: float = 7.0, alpha: float = 1.702) -> Tensor:
    """y = a' sigmoid(alpha a') (b' + 1), a' = min(a, limit), b' = clip(b, -limit, limit)."""


@declare
def clamped_dswiglu(dy: Tensor, x: Tensor, limit: float = 7.0, alpha: float = 1.702) -> Tensor:
    """dx = [dy (b' + 1) (s + alpha a' s (1 - s)) [a <= limit], dy a' s [|b| <= limit]], s = sigmoid(alpha a')."""


@declare(mutates=("amax_out",))
def activation_quantize(x: Tensor, activation: str, fp8_scale: Tensor, fp8_dtype: dtype, limit: float = 7.0, alpha: float = 1.702,
                        amax_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """y = act(x) for ``activation`` (one of the twelve forward op names above), quantized per tensor.

    Returns: (q, scale_inv, amax) as ``quantize(act(x), fp8_scale, fp8_dtype, amax_out)``; ``limit``
    and ``alpha`` are used by clamped_swiglu only.
    """


@declare(mutates=("x",))
def dactivation_(dy: Tensor, x: Tensor, activation: str, limit: float = 7.0, alpha: float = 1.702) -> Tensor:
    """x <- the backward of ``activation`` (one of the twelve forward op names) written over its input x.

    x = d<activation>(dy, x) in place (``clamped_dswiglu`` for clamped_swiglu), for a backward that
    no longer needs x afterwards: the gradient then takes no memory of its own. x must be contiguous.
    Returns: x. ``limit`` and ``alpha`` are used by clamped_swiglu only.
    """
