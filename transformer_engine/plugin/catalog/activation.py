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
"""

from transformer_engine.plugin.core.catalog import declare


@declare
def gelu(x):
    """y = gelu_tanh(x)."""


@declare
def dgelu(dy, x):
    """dx = dy * gelu_tanh'(x)."""


@declare
def qgelu(x):
    """y = x * sigmoid(1.702 x)."""


@declare
def dqgelu(dy, x):
    """dx = dy * (s + 1.702 x s (1 - s)), s = sigmoid(1.702 x)."""


@declare
def relu(x):
    """y = max(x, 0)."""


@declare
def drelu(dy, x):
    """dx = dy * [x > 0]."""


@declare
def srelu(x):
    """y = max(x, 0)^2."""


@declare
def dsrelu(dy, x):
    """dx = dy * 2 max(x, 0)."""


@declare
def silu(x):
    """y = x * sigmoid(x)."""


@declare
def dsilu(dy, x):
    """dx = dy * (s + x s (1 - s)), s = sigmoid(x)."""


@declare
def glu(x):
    """y = sigmoid(a) * b."""


@declare
def dglu(dy, x):
    """dx = [dy * b * s (1 - s), dy * s], s = sigmoid(a)."""


@declare
def geglu(x):
    """y = gelu_tanh(a) * b."""


@declare
def dgeglu(dy, x):
    """dx = [dy * b * gelu_tanh'(a), dy * gelu_tanh(a)]."""


@declare
def qgeglu(x):
    """y = qgelu(a) * b."""


@declare
def dqgeglu(dy, x):
    """dx = [dy * b * qgelu'(a), dy * qgelu(a)]."""


@declare
def reglu(x):
    """y = relu(a) * b."""


@declare
def dreglu(dy, x):
    """dx = [dy * b * [a > 0], dy * relu(a)]."""


@declare
def sreglu(x):
    """y = relu(a)^2 * b."""


@declare
def dsreglu(dy, x):
    """dx = [dy * b * 2 relu(a), dy * relu(a)^2]."""


@declare
def swiglu(x):
    """y = silu(a) * b."""


@declare
def dswiglu(dy, x):
    """dx = [dy * b * silu'(a), dy * silu(a)]."""


@declare
def clamped_swiglu(x, limit=7.0, alpha=1.702):
    """y = a' sigmoid(alpha a') (b' + 1), a' = min(a, limit), b' = clip(b, -limit, limit)."""


@declare
def clamped_dswiglu(dy, x, limit=7.0, alpha=1.702):
    """dx = [dy (b' + 1) (s + alpha a' s (1 - s)) [a <= limit], dy a' s [|b| <= limit]], s = sigmoid(alpha a')."""


@declare
def activation_quantize(x, activation, fp8_scale, fp8_dtype, limit=7.0, alpha=1.702, amax_out=None):
    """y = act(x) for ``activation`` (one of the twelve forward op names above), quantized per tensor.

    Returns: (q, scale_inv, amax) as ``quantize(act(x), fp8_scale, fp8_dtype, amax_out)``; ``limit``
    and ``alpha`` are used by clamped_swiglu only.
    """


@declare
def dactivation_(dy, x, activation, limit=7.0, alpha=1.702):
    """x <- the backward of ``activation`` (one of the twelve forward op names) written over its input x.

    x = d<activation>(dy, x) in place (``clamped_dswiglu`` for clamped_swiglu), for a backward that
    no longer needs x afterwards: the gradient then takes no memory of its own. x must be contiguous.
    Returns: x. ``limit`` and ``alpha`` are used by clamped_swiglu only.
    """
