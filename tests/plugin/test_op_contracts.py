"""Every catalog op's edge cases, run on every backend available here, must behave the same.

The catalog (``transformer_engine/plugin/catalog``) states each op's edge-case contract: empty
tensors and zero-size dims, NaN / inf inputs, out-of-range targets, non-contiguous inputs. Each
case below is run through every registered implementation the way the dispatcher would: its
``supports`` predicate first (a backend may decline a call, the dispatcher then runs the next one:
no contract breach), then the function. All implementations that accept the call must agree:
the same exception type, or results of equal shapes and dtypes, equal within the dtype's tolerance
(``tests.utils.DTYPE_TOLS``, 4x for float32 reductions, as in the flagos tier), NaN and +-inf in the
same places. The reference backend runs on the CPU; the flagos kernels run in Triton's interpreter
(imported so by the root conftest) when Triton is installed, on small shapes to keep CPU time low; vendor.cuda's
activations (PyTorch's own operators, which run on any device) run here on the CPU too.
"""

from __future__ import annotations

import os

import pytest
import torch

import transformer_engine.plugin.catalog  # noqa: F401  (declares the ops)
from tests.utils import dtype_tols
from transformer_engine.plugin.backends import reference
from transformer_engine.plugin.backends._registration import impls_from_modules
from transformer_engine.plugin.backends.vendor.cuda import activation as vendor_activation
from transformer_engine.plugin.catalog.attention import AttentionConfig
from transformer_engine.plugin.core import BackendImplKind, Capabilities, OpRegistry
from transformer_engine.plugin.core.catalog import list_specs

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
NAN, INF = float("nan"), float("inf")


def _registry() -> OpRegistry:
    registry = OpRegistry()
    reference.register(registry)
    registry.register_many(impls_from_modules([vendor_activation], "vendor.cuda", BackendImplKind.VENDOR,
                                              Capabilities(device_types=frozenset({"cpu"})), vendor="cuda"))
    try:
        from tests.plugin.backends.flagos._interpreter import import_kernels
    except ImportError:  # no torch-side triton at all
        return registry
    if import_kernels() == "":
        from transformer_engine.plugin.backends import flagos

        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if not torch.cuda.is_available() else os.environ.get("TRITON_INTERPRET", "0")
        try:
            flagos.register(registry)  # its capabilities read the variable: CPU under the interpreter
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return registry


REGISTRY = _registry()


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Triton also reads TRITON_INTERPRET at launch (see tests/plugin/backends/flagos/conftest.py)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _quiet_interpreter(recwarn):
    """The interpreter evaluates with numpy, which warns on inf - inf and exp overflow (handled by the kernels)."""


# -- inputs --------------------------------------------------------------------------------------


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def nonfinite(*shape, dtype=torch.float32):
    """Random values with a NaN, a +inf and a -inf planted in the first row."""
    x = torch.randn(*shape)
    flat = x.view(-1)
    if flat.numel() >= 3:
        flat[0], flat[1], flat[2] = NAN, INF, -INF
    return x.to(dtype)


def strided(*shape, dtype=torch.float32):
    """A non-contiguous view: every other column of a twice-as-wide tensor."""
    return torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]


def transposed(*shape, dtype=torch.float32):
    """A non-contiguous [.., a, b] tensor: the transpose of a contiguous [.., b, a] one."""
    return torch.randn(*shape[:-2], shape[-1], shape[-2]).to(dtype).transpose(-1, -2)


def scale1(value=2.0):
    return torch.tensor([value])


# -- the cases: op -> [(case id, args factory, kwargs)] ------------------------------------------

PLAIN_ACTS = ("gelu", "qgelu", "relu", "srelu", "silu")
GATED_ACTS = ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu")
BACKWARD = {"clamped_swiglu": "clamped_dswiglu"}

CASES = {}


def case(op, name, make, **kwargs):
    CASES.setdefault(op, []).append((name, make, kwargs))


for act in PLAIN_ACTS + GATED_ACTS:
    d_act = BACKWARD.get(act, "d" + act)
    case(act, "empty", lambda: (rnd(0, 8),))
    case(act, "zero_width", lambda: (rnd(3, 0),))
    case(act, "nonfinite", lambda: (nonfinite(3, 8),))
    case(act, "noncontiguous", lambda: (strided(3, 8),))
    case(act, "bf16_noncontiguous", lambda: (transposed(8, 6, dtype=torch.bfloat16),))
    case(d_act, "empty", lambda a=act: (rnd(0, 4 if a in GATED_ACTS else 8), rnd(0, 8)))
    case(d_act, "nonfinite", lambda a=act: (nonfinite(3, 4 if a in GATED_ACTS else 8), nonfinite(3, 8)))
    case(d_act, "noncontiguous", lambda a=act: (strided(3, 4 if a in GATED_ACTS else 8), strided(3, 8)))
case("swiglu", "odd_last_dim", lambda: (rnd(3, 7),))
case("activation_quantize", "empty", lambda: (rnd(0, 8), "gelu", scale1(), E4M3))
case("activation_quantize", "nonfinite", lambda: (nonfinite(3, 8), "swiglu", scale1(), E4M3))
case("activation_quantize", "noncontiguous", lambda: (strided(3, 8), "silu", scale1(), E4M3))
case("activation_quantize", "unknown_activation", lambda: (rnd(3, 8), "tanh", scale1(), E4M3))

for fwd, bwd in (
    ("scaled_softmax_forward", "scaled_softmax_backward"),
    ("scaled_masked_softmax_forward", "scaled_masked_softmax_backward"),
    ("scaled_upper_triang_masked_softmax_forward", "scaled_upper_triang_masked_softmax_backward"),
    ("scaled_aligned_causal_masked_softmax_forward", "scaled_aligned_causal_masked_softmax_backward"),
):
    three_d = "upper_triang" in fwd
    shape = (2, 5, 5) if three_d else (1, 2, 5, 5)
    empty = (0, 5, 5) if three_d else (0, 2, 5, 5)

    def args(x, f=fwd):
        if "masked_softmax_forward" in f and "causal" not in f and "triang" not in f:
            return (x, torch.zeros(1, 1, *x.shape[-2:], dtype=torch.bool), 0.5)
        return (x, 0.5)

    case(fwd, "empty", lambda s=empty, a=args: a(rnd(*s)))
    case(fwd, "nonfinite", lambda s=shape, a=args: a(nonfinite(*s)))
    case(fwd, "noncontiguous", lambda s=shape, a=args: a(transposed(*s)))
    case(bwd, "empty", lambda s=empty: (rnd(*s), torch.softmax(rnd(*s), -1), 0.5))
    case(bwd, "nonfinite", lambda s=shape: (nonfinite(*s), torch.softmax(rnd(*s), -1), 0.5))
    case(bwd, "noncontiguous", lambda s=shape: (transposed(*s), torch.softmax(rnd(*s), -1).transpose(-1, -2), 0.5))

for norm in ("layernorm", "rmsnorm"):
    bias = (lambda h: (torch.randn(h),)) if norm == "layernorm" else (lambda h: ())

    def fwd_args(x, b=bias):
        return (x, torch.randn(x.shape[-1]), *b(x.shape[-1]), 1e-5)

    case(f"{norm}_fwd", "empty_rows", lambda f=fwd_args: f(rnd(0, 8)))
    case(f"{norm}_fwd", "zero_width", lambda f=fwd_args: f(rnd(3, 0)))
    case(f"{norm}_fwd", "nonfinite", lambda f=fwd_args: f(nonfinite(3, 8)))
    case(f"{norm}_fwd", "noncontiguous", lambda f=fwd_args: f(strided(3, 8)))
    case(f"{norm}_fwd", "fp8_nonfinite", lambda f=fwd_args: f(nonfinite(3, 8)), fp8_scale=scale1(), fp8_dtype=E4M3)


def _norm_bwd_args(norm, x, dy):
    w = torch.randn(x.shape[-1])
    rows = x.numel() // max(x.shape[-1], 1)
    if norm == "layernorm":
        return (dy, x, torch.zeros(rows), torch.ones(rows), w)
    return (dy, x, torch.ones(rows), w)


for norm in ("layernorm", "rmsnorm"):
    case(f"{norm}_bwd", "empty_rows", lambda n=norm: _norm_bwd_args(n, rnd(0, 8), rnd(0, 8)))
    case(f"{norm}_bwd", "nonfinite", lambda n=norm: _norm_bwd_args(n, rnd(3, 8), nonfinite(3, 8)))
    case(f"{norm}_bwd", "noncontiguous", lambda n=norm: _norm_bwd_args(n, strided(3, 8), strided(3, 8)))

for op in ("quantize", "cast_transpose", "quantize_transposed", "cast_transpose_dbias"):
    case(op, "empty", lambda: (rnd(0, 8), scale1(), E4M3))
    case(op, "zero_cols", lambda: (rnd(4, 0), scale1(), E4M3))
    case(op, "nonfinite", lambda: (nonfinite(4, 8), scale1(), E4M3))
    case(op, "noncontiguous", lambda: (transposed(4, 8), scale1(), E4M3))
case("quantize", "nonfinite_amax_out", lambda: (nonfinite(4, 8), scale1(), E4M3, torch.tensor([1.0])))
case("dequantize", "empty", lambda: (rnd(0, 8).to(E4M3), torch.tensor(0.5), torch.float32))
case("dequantize", "nonfinite", lambda: (nonfinite(4, 8).to(E4M3), torch.tensor(0.5), torch.bfloat16))
case("dequantize", "noncontiguous", lambda: (transposed(4, 8).to(E4M3), torch.tensor(0.5), torch.float32))
case("fp8_transpose", "empty", lambda: (rnd(0, 8).to(E4M3),))
case("fp8_transpose", "noncontiguous", lambda: (transposed(4, 8).to(E4M3),))
case("compute_amax", "empty", lambda: (rnd(0, 8),))
case("compute_amax", "nonfinite", lambda: (nonfinite(4, 8),))
case("compute_amax", "all_nonfinite", lambda: (torch.tensor([NAN, INF, -INF]),))
case("compute_amax", "noncontiguous", lambda: (transposed(4, 8, dtype=torch.bfloat16),))
case("current_scale", "empty", lambda: (rnd(0, 8), E4M3))
case("current_scale", "nonfinite", lambda: (nonfinite(4, 8), E4M3))
case("current_scale", "noncontiguous", lambda: (transposed(4, 8), E4M3))
for value in (0.0, NAN, INF, 1e-40):
    case("scale_from_amax", f"amax_{value}", lambda v=value: (torch.tensor(v), E4M3))
for op, extra in (
    ("quantize_blockwise", (1, 4, False, 0.0)),
    ("cast_transpose_blockwise", (4, False, 0.0)),
    ("cast_transpose_blockwise_dbias", (4, False, 0.0)),
):
    case(op, "empty", lambda e=extra: (rnd(0, 8), E4M3, *e))
    case(op, "nonfinite", lambda e=extra: (nonfinite(4, 8), E4M3, *e))
    case(op, "noncontiguous", lambda e=extra: (transposed(4, 8), E4M3, *e))
case("block_amax_of_range", "empty", lambda: (rnd(0), 4, 8, 12, 2, 4))
case("block_amax_of_range", "nonfinite", lambda: (nonfinite(4, 8).reshape(-1)[3:20], 4, 8, 3, 2, 4))
case("block_amax_of_range", "noncontiguous", lambda: (transposed(4, 8), 8, 4, 0, 2, 4))
case("quantize_blockwise_range", "empty", lambda: (rnd(0), torch.ones(2, 2), 4, 8, 12, 2, 4, E4M3, False, 0.0))
case("quantize_blockwise_range", "nonfinite", lambda: (nonfinite(4, 8).reshape(-1)[3:20], torch.tensor([[1.0, INF], [NAN, 0.0]]),
                                                       4, 8, 3, 2, 4, E4M3, True, 0.0))
case("dequantize_blockwise", "empty", lambda: (rnd(0, 8).to(E4M3), torch.ones(0, 2), 1, 4, torch.float32))
case("delayed_scaling_update", "nonfinite", lambda: (torch.tensor([[NAN, INF, 0.0, 2.0]]), torch.ones(4), 448.0, 0.0, "max"))
case("delayed_scaling_update", "no_tensors", lambda: (torch.zeros(3, 0), torch.ones(0), 448.0, 0.0, "max"))
case("delayed_scaling_update_many_", "nonfinite_two_lengths", lambda: (
    [torch.tensor([[NAN, INF, 0.0, 2.0], [1.0, 3.0, 5.0, 0.5]]), torch.tensor([[1e-30, 4.0]])],
    [torch.ones(4), torch.full((2,), 2.0)], [torch.empty(4), torch.empty(2)], 448.0, 1.0, "max"))
case("delayed_scaling_update_many_", "no_states", lambda: ([], [], [], 448.0, 0.0, "most_recent"))
case("delayed_scaling_update_many_", "shared_memory", lambda: (
    [torch.ones(2, 3)] * 2, [torch.ones(3), torch.ones(3)], [torch.ones(3), torch.ones(3)], 448.0, 0.0, "max"))
case("delayed_scaling_update_many_", "fp8_max_per_slot", lambda: (
    [torch.ones(2, 3)], [torch.ones(3)], [torch.ones(3)], torch.full((3,), 448.0), 0.0, "max"))

case("dropout_fwd", "empty", lambda: (rnd(0, 8), 0.5))
case("dropout_fwd", "p_one_nonfinite", lambda: (nonfinite(4, 8), 1.0))
case("dropout_bwd", "empty", lambda: (rnd(0, 8), torch.zeros(0, dtype=torch.uint8), 0.5))
case("dropout_bwd", "noncontiguous", lambda: (strided(4, 8), torch.full((4,), 0x5A, dtype=torch.uint8), 0.5))
case("dropout_bwd_dbias", "empty_rows", lambda: (rnd(0, 8), torch.zeros(0, dtype=torch.uint8), 0.5))
case("dropout_bwd_dbias", "nonfinite", lambda: (nonfinite(4, 8), torch.full((4,), 0x5A, dtype=torch.uint8), 0.5))
case("bias_dropout_add_fwd", "empty", lambda: (rnd(0, 8), rnd(8), rnd(0, 8), 0.5))
case("bias_dropout_add_fwd", "p_zero_noncontiguous", lambda: (strided(4, 8), rnd(8), strided(4, 8), 0.0))


def _ce(logits, target, **kw):
    return (logits, target)


case("cross_entropy_fwd", "target_out_of_range", lambda: (rnd(3, 7), torch.tensor([1, 7, -1])))
case("cross_entropy_fwd", "ignored_rows", lambda: (rnd(3, 7), torch.tensor([1, -100, 6])))
case("cross_entropy_fwd", "empty_rows", lambda: (rnd(0, 7), torch.zeros(0, dtype=torch.long)))
case("cross_entropy_fwd", "empty_vocab", lambda: (rnd(3, 0), torch.zeros(3, dtype=torch.long)))
case("cross_entropy_fwd", "nonfinite", lambda: (nonfinite(3, 7), torch.tensor([3, 0, 1])))
case("cross_entropy_fwd", "noncontiguous", lambda: (transposed(3, 7, dtype=torch.bfloat16), torch.tensor([3, 0, 1])))
case("cross_entropy_fwd", "float_target", lambda: (rnd(3, 7), torch.zeros(3)))


def _ce_bwd(logits, target):
    lse = torch.logsumexp(logits.float(), -1)
    return (torch.ones(target.shape), logits, target, lse)


case("cross_entropy_bwd", "target_out_of_range", lambda: _ce_bwd(rnd(3, 7), torch.tensor([1, 7, -1])))
case("cross_entropy_bwd", "ignored_rows", lambda: _ce_bwd(rnd(3, 7), torch.tensor([1, -100, 6])))
case("cross_entropy_bwd", "empty_rows", lambda: _ce_bwd(rnd(0, 7), torch.zeros(0, dtype=torch.long)))
case("cross_entropy_bwd", "empty_vocab", lambda: (torch.ones(3), rnd(3, 0), torch.zeros(3, dtype=torch.long), torch.zeros(3)))
case("cross_entropy_bwd", "noncontiguous", lambda: _ce_bwd(transposed(3, 7), torch.tensor([3, 0, 1])))


def _flag():
    return torch.zeros(1, dtype=torch.int32)


def _adam_lists(tensors):
    return [[t.clone() for t in tensors] for _ in range(4)]


case("multi_tensor_scale", "empty_lists", lambda: (64, _flag(), [[], []], 2.0))
case("multi_tensor_scale", "nonfinite", lambda: (64, _flag(), [[nonfinite(9), rnd(0)], [rnd(9), rnd(0)]], 2.0))
case("multi_tensor_scale", "unequal_lengths", lambda: (64, _flag(), [[rnd(3)], []], 2.0))
case("multi_tensor_l2norm", "empty_lists", lambda: (64, _flag(), [[]]))
case("multi_tensor_l2norm", "nonfinite", lambda: (64, _flag(), [[nonfinite(9), rnd(0)]]), per_tensor=True)
case("multi_tensor_adam", "empty_tensor", lambda: (64, _flag(), _adam_lists([rnd(0), rnd(5)]), 1e-3, 0.9, 0.99, 1e-8, 1, 1, True, 0.0))
case("multi_tensor_adam", "nonfinite_grad",
     lambda: (64, _flag(), [[nonfinite(5)], [rnd(5)], [rnd(5)], [rnd(5).abs()]], 1e-3, 0.9, 0.99, 1e-8, 1, 1, True, 0.0))
case("multi_tensor_sgd", "empty_tensor", lambda: (64, _flag(), [[rnd(0)], [rnd(0)], [rnd(0)]], 0.0, 0.9, 0.0, 0.1, False, True, False, 1.0))


def _freqs(s, d):
    return torch.randn(s, 1, 1, d)


for op in ("fused_rope_forward", "fused_rope_backward"):
    case(op, "empty_batch", lambda: (rnd(4, 0, 2, 8), _freqs(4, 8)))
    case(op, "nonfinite", lambda: (nonfinite(4, 1, 2, 8), _freqs(4, 8)))
    case(op, "noncontiguous", lambda: (rnd(2, 4, 2, 8).transpose(0, 1), _freqs(4, 8)))

_CFG = AttentionConfig(softmax_scale=0.5, mask_type="causal")
case("fused_attn_fwd", "empty_batch",
     lambda: (rnd(0, 5, 2, 8, dtype=torch.float16), rnd(0, 5, 2, 8, dtype=torch.float16), rnd(0, 5, 2, 8, dtype=torch.float16), _CFG))
case("fused_attn_fwd", "noncontiguous", lambda: tuple(rnd(5, 1, 2, 8, dtype=torch.float16).transpose(0, 1) for _ in range(3)) + (_CFG,))
_ONE = torch.tensor(1.0)


def _fp8_attention_operands(b: int, transposed: bool = False):
    """FP8 q, k, v [b, 5, 2, 8] (views of [5, b, 2, 8] tensors when ``transposed``) and the forward's three scales."""
    make = (lambda: rnd(5, b, 2, 8).transpose(0, 1)) if transposed else (lambda: rnd(b, 5, 2, 8))
    return tuple(make().to(E4M3) for _ in range(3)) + (_ONE, torch.tensor(448.0), torch.tensor(4.0))


case("fused_attn_fp8_fwd", "empty_batch", lambda: _fp8_attention_operands(0) + (_CFG,))
case("fused_attn_fp8_fwd", "noncontiguous", lambda: _fp8_attention_operands(2, transposed=True) + (_CFG,))
case("fused_attn_fp8_bwd", "empty_batch",
     lambda: (rnd(0, 5, 2, 8).to(E5M2), *_fp8_attention_operands(0)[:3], rnd(0, 5, 2, 8).to(E4M3), rnd(0, 2, 5),
              _ONE, _ONE, _ONE, torch.tensor(448.0), _ONE, _ONE, _CFG))
case("attention_block_fwd", "empty_batch",
     lambda: (rnd(0, 5, 2, 8, dtype=torch.float16), rnd(0, 5, 2, 8, dtype=torch.float16), rnd(0, 5, 2, 8, dtype=torch.float16), _CFG))
case("attention_block_fwd", "noncontiguous",
     lambda: tuple(rnd(5, 1, 2, 8, dtype=torch.float16).transpose(0, 1) for _ in range(3)) + (_CFG,))
case("attention_max_logit", "empty_batch", lambda: (rnd(0, 5, 2, 8, dtype=torch.float16), rnd(0, 5, 2, 8, dtype=torch.float16), _CFG))
case("attention_max_logit", "noncontiguous",
     lambda: tuple(rnd(5, 1, 2, 8, dtype=torch.float16).transpose(0, 1) for _ in range(2)) + (_CFG,))

case("gemm", "empty_m", lambda: (rnd(0, 4), rnd(4, 3)))
case("gemm", "empty_k_bias", lambda: (rnd(2, 0), rnd(0, 3), rnd(3)))
case("gemm", "nonfinite", lambda: (nonfinite(2, 4), rnd(4, 3)))
case("gemm", "noncontiguous", lambda: (transposed(2, 4), transposed(4, 3)))
case("gemm_grouped", "empty_and_nonfinite_splits", lambda: (nonfinite(5, 4), rnd(3, 2, 4), (2, 0, 3)))
case("gemm_grouped", "fp8_bias_strided_b", lambda: (rnd(6, 16).to(E4M3), transposed(3, 8, 16).to(E4M3), (4, 0, 2),
                                                    torch.full((3,), 0.5), torch.full((6,), 2.0)[::2], torch.bfloat16, rnd(3, 8)))
case("gemm_grouped", "empty_m", lambda: (rnd(0, 4), rnd(2, 3, 4), (0, 0)))
case("gemm_grouped_wgrad", "empty_split_is_zero", lambda: (nonfinite(3, 5), rnd(4, 5), (2, 0, 3)))
case("gemm_grouped_wgrad", "fp8_noncontiguous", lambda: (transposed(8, 32).to(E4M3), transposed(16, 32).to(E5M2), (16, 16),
                                                         torch.full((2,), 0.5), torch.ones(2), torch.float32))
case("gemm_grouped_wgrad", "empty_m", lambda: (rnd(3, 0), rnd(4, 0), (0,)))
case("cast_transpose_grouped", "empty_splits_nonfinite", lambda: (nonfinite(5, 8), (2, 0, 3), torch.tensor([2.0, 1.0, 0.5]), E4M3))
case("cast_transpose_grouped", "strided_slots", lambda: (transposed(6, 8, dtype=torch.bfloat16), (4, 2), torch.full((6,), 4.0)[::3], E5M2,
                                                         torch.tensor([[1.0, 0.0, 0.0, 9e9, 0.0, 0.0]])[0, ::3]))
case("cast_transpose_grouped", "empty", lambda: (rnd(0, 8), (0, 0), torch.ones(2), E4M3))
case("column_sums_grouped", "empty_split_nonfinite", lambda: (nonfinite(5, 8), (2, 0, 3)))
case("column_sums_grouped", "bf16_noncontiguous", lambda: (transposed(6, 8, dtype=torch.bfloat16), (4, 2), torch.bfloat16))
case("column_sums_grouped", "empty", lambda: (rnd(0, 8), (0,)))
case("current_scale_grouped", "empty_splits_nonfinite", lambda: (nonfinite(5, 8), (2, 0, 3), E4M3))
case("current_scale_grouped", "empty", lambda: (rnd(0, 8), (0, 0), E5M2))
case("current_scale_grouped", "bf16_transposed_eps_pow2", lambda: (transposed(6, 8, dtype=torch.bfloat16), (4, 2), E4M3, 1e-3, True))

NVFP4_PLAIN = (True, True, False, False, False, None)  # rowwise, columnwise, block_2d, rht, stochastic_rounding, seed
case("quantize_nvfp4", "empty", lambda: (rnd(0, 32), *NVFP4_PLAIN))
case("quantize_nvfp4", "nonfinite", lambda: (nonfinite(16, 32), *NVFP4_PLAIN))
case("quantize_nvfp4", "noncontiguous_2d", lambda: (transposed(16, 32, dtype=torch.bfloat16), True, True, True, False, False, None))
case("quantize_nvfp4", "rht_stochastic", lambda: (rnd(32, 16, dtype=torch.bfloat16), True, True, False, True, True, torch.tensor([5])))
case("quantize_nvfp4", "misaligned", lambda: (rnd(16, 24), *NVFP4_PLAIN))
case("quantize_nvfp4", "4over6_nonfinite_2d", lambda: (nonfinite(16, 32), True, True, True, False, False, None),
     four_over_six="MSE", e4m3_max=256)
case("quantize_nvfp4", "4over6_empty", lambda: (rnd(0, 32), *NVFP4_PLAIN), four_over_six="MAE")
case("quantize_nvfp4", "4over6_rht", lambda: (rnd(32, 16), True, True, False, True, False, None), four_over_six="MAE")


def _nvfp4_operand(rows, k):
    """Every E2M1 code pair and every E4M3 scale code (0x7F: NaN) of a [rows, k] NVFP4 operand."""
    q = torch.arange(rows * k // 2).remainder(256).to(torch.uint8).reshape(rows, k // 2)
    return q, torch.arange(rows * k // 16).remainder(128).to(torch.uint8).reshape(rows, k // 16), torch.tensor([3.0])


case("dequantize_nvfp4", "empty", lambda: (*_nvfp4_operand(0, 32), torch.float32))
case("dequantize_nvfp4", "every_code", lambda: (*_nvfp4_operand(64, 64), torch.bfloat16))
case("dequantize_nvfp4", "every_code_bound_256", lambda: (*_nvfp4_operand(64, 64), torch.float32), e4m3_max=256)


def _nvfp4_gemm(m, n, k):
    (a, a_scale, a_amax), (b, b_scale, b_amax) = _nvfp4_operand(m, k), _nvfp4_operand(n, k)
    return (a, b, a_scale, b_scale, a_amax, b_amax, torch.float32)


case("gemm_nvfp4", "empty_m", lambda: _nvfp4_gemm(0, 4, 32))
case("gemm_nvfp4", "empty_k_bias", lambda: _nvfp4_gemm(2, 3, 0) + (rnd(3),))
case("gemm_nvfp4", "every_code", lambda: _nvfp4_gemm(16, 8, 64))
case("gemm_nvfp4", "every_code_bound_256", lambda: _nvfp4_gemm(16, 8, 64), a_e4m3_max=256)

MXFP8_BOTH = (E4M3, True, True)  # fp8_dtype, rowwise, columnwise
case("quantize_mxfp8", "empty", lambda: (rnd(0, 32), *MXFP8_BOTH))
case("quantize_mxfp8", "nonfinite", lambda: (nonfinite(32, 32), *MXFP8_BOTH))
case("quantize_mxfp8", "noncontiguous_e5m2", lambda: (transposed(32, 64, dtype=torch.bfloat16), torch.float8_e5m2, True, True))
case("quantize_mxfp8", "misaligned", lambda: (rnd(16, 48), *MXFP8_BOTH))


def _mxfp8_operand(rows, k, scale_codes=256):
    """Every E4M3 code (0x7F, 0xFF: NaN) and E8M0 scale codes 0 .. scale_codes - 1 (255: NaN) of a [rows, k] operand."""
    q = torch.arange(rows * k).remainder(256).to(torch.uint8).reshape(rows, k).view(E4M3)
    return q, (torch.arange(rows * k // 32).remainder(scale_codes) + (256 - scale_codes) // 2).to(torch.uint8).reshape(rows, k // 32)


case("dequantize_mxfp8", "empty", lambda: (*_mxfp8_operand(0, 32), torch.float32))
case("dequantize_mxfp8", "every_code", lambda: (*_mxfp8_operand(64, 128), torch.bfloat16))


def _mxfp8_gemm(m, n, k):
    (a, a_scale), (b, b_scale) = _mxfp8_operand(m, k, 64), _mxfp8_operand(n, k, 64)  # scales 2^-31 .. 2^32: finite sums
    return (a, b, a_scale, b_scale, torch.float32)


case("gemm_mxfp8", "empty_m", lambda: _mxfp8_gemm(0, 4, 32))
case("gemm_mxfp8", "empty_k_bias", lambda: _mxfp8_gemm(2, 3, 0) + (rnd(3),))
case("gemm_mxfp8", "every_code", lambda: _mxfp8_gemm(16, 8, 64))


# -- running and comparing -----------------------------------------------------------------------


def _outcome(impl, make, kwargs):
    """('declined', reason) | ('raised', exception type) | ('result', output), for fresh arguments."""
    torch.manual_seed(1234)
    args = make()
    if impl.supports is not None:
        verdict = impl.supports(*args, **kwargs)
        if not verdict:
            return "declined", getattr(verdict, "reason", verdict), args
    try:
        return "result", impl.fn(*args, **kwargs), args
    except (ValueError, TypeError, NotImplementedError, IndexError, RuntimeError) as exc:
        return "raised", exc, args


def _leaves(value, args):
    """The tensors an op call produced: its outputs, then its (possibly mutated) tensor arguments."""
    out = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    walk(args)
    return out


def _assert_same_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not a.is_floating_point():
        if a.dtype == torch.uint8:  # packed dropout masks are random per backend: shapes only
            return
        assert torch.equal(a, b), where
        return
    a64, b64 = a.float().double(), b.float().double()
    assert torch.equal(torch.isnan(a64), torch.isnan(b64)), f"{where}: NaN positions differ"
    assert torch.equal(torch.isposinf(a64), torch.isposinf(b64)) and torch.equal(torch.isneginf(a64),
                                                                                 torch.isneginf(b64)), f"{where}: inf positions differ"
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    tol = dtype_tols(a.dtype if a.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32)
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # one FP8 step apart at most (rounding ties)
        tol = {"rtol": 0.125, "atol": 0.0}
    tol = {k: 4 * v for k, v in tol.items()}
    torch.testing.assert_close(a64[finite], b64[finite], **tol, msg=lambda m: f"{where}: {m}")


_PARAMS = [pytest.param(op, name, make, kwargs, id=f"{op}-{name}") for op, cases in sorted(CASES.items()) for name, make, kwargs in cases]


def test_every_op_has_edge_cases():
    """New catalog ops get edge cases here (attention backward reuses the forward's ctx: covered by its tier)."""
    missing = {spec.name for spec in list_specs()} - set(CASES) - {"fused_attn_bwd", "attention_block_bwd", "gemm_blockwise",
                                                                   "dactivation_",
                                                                   "delayed_scaling_update_"}
    assert not missing, f"catalog ops without edge cases: {sorted(missing)}"


@pytest.mark.parametrize("op,name,make,kwargs", _PARAMS)
def test_edge_case_same_on_every_backend(op, name, make, kwargs):
    impls = sorted(REGISTRY.get_implementations(op), key=lambda impl: impl.impl_id != reference.IMPL_ID)
    assert impls and impls[0].impl_id == reference.IMPL_ID, f"no reference implementation of {op}"
    base_kind, base, base_args = _outcome(impls[0], make, kwargs)
    assert base_kind != "declined", f"the reference backend declined {op} {name}: {base}"
    for impl in impls[1:]:
        if not impl.capabilities.device_types or "cpu" in impl.capabilities.device_types:
            kind, value, args = _outcome(impl, make, kwargs)
        else:
            continue
        where = f"{op} {name}: {impl.impl_id} vs reference"
        if kind == "declined":
            continue
        assert kind == base_kind, f"{where}: {kind} {value!r} vs {base_kind} {base!r}"
        if kind == "raised":
            assert type(value) is type(base), f"{where}: {type(value).__name__} vs {type(base).__name__} ({value} / {base})"
            continue
        if "dropout" in op and op != "dropout_bwd" and name != "p_zero_noncontiguous" and "p_one" not in name:
            continue  # random masks: only the deterministic cases compare values
        a, b = _leaves(value, args), _leaves(base, base_args)
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tensor(x, y, f"{where}, tensor {i}")
