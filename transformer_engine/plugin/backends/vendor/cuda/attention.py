"""PyTorch's SDPA kernels (cuDNN, FlashAttention-2, memory-efficient) as ``fused_attn_fwd`` / ``fused_attn_bwd``.

See plugin/catalog/attention.py for the op's contract. For each batch entry and query head,
with S = softmax_scale * Q K^T + B:

    forward   P = softmax(S),  O = dropout(P) V            (the kernel also returns lse = log sum exp S)
    backward  dS = P * (dP - D),  D_i = sum_d dO_id O_id,  dP = dropout^T(dO V^T)
              dQ = scale dS K,  dK = scale dS^T Q,  dV = dropout(P)^T dO,  dB = dS

Kernels, tried in this order (the ``torch.ops.aten._scaled_dot_product_*`` ops and their backward
ops; the forward's log-sum-exp, philox seed / offset and sequence lengths travel in ``ctx``, which
names the kernel, so the backward runs the matching one):

- cudnn: fp16 / bf16, d_qk and d_v multiples of 8 up to 128 (256 on sm_90 with cuDNN >= 9.5.1),
  compute capability >= 8.0, cuDNN >= 9, and the op schemas that torch 2.11 and 2.13 share (any
  other schema is declined). It takes ``attn_mask`` as an additive bias, but returns no bias gradient, so
  a user ``attn_bias`` goes to the efficient kernel.
- flash: fp16 / bf16, no mask or bias, d_qk == d_v, d % 8 == 0, d <= 256, compute capability >= 8.0.
- memory-efficient: everything else that SDPA can do, fp32 included.

Masks: each kernel's causal flag has one alignment when s_q != s_kv (``_KERNELS``; measured on the
H200 against the reference: cuDNN and the efficient kernel top-left, i.e. the catalog's "causal";
flash bottom-right). A kernel whose flag means the other alignment gets the causal mask folded into
its additive bias if it takes one, and is passed over otherwise (also when the call has no mask or bias
of its own and a later kernel's flag fits: folding would build an [s_q, s_kv] bias per call, 13.5 ms of
``masked_fill`` per step for context parallelism's all-gathered keys at 32k tokens, H100); so does cuDNN
whenever it gets a bias (its backward with both the causal flag and a bias gave wrong gradients, torch 2.11 / cuDNN
9.19). ``attn_mask`` and folded masks become -finfo.max / 2 in q's dtype, added to a post-scale
``attn_bias``; the bias is stored with its last dim padded to a multiple of 16 (the kernels'
alignment). Rows with every key masked (by ``attn_mask`` and the causal mask together) get O = 0
and zero gradients, as the contract says.

GQA / MQA: the kv heads are repeated to h heads and their gradients summed over each group.
Declined (``SUPPORTS``, with the reason): packed "thd", sliding windows, pre-scale bias, ALiBi,
off-by-one and learnable softmax, head dims the kernels cannot align.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from transformer_engine.plugin.catalog.attention import AttentionConfig, check_attention_layout
from transformer_engine.plugin.core import Reject

__all__ = ["fused_attn_fwd", "fused_attn_bwd"]

_HALF = (torch.float16, torch.bfloat16)
_BIAS_ALIGN = 16  # the kernels read the bias in rows padded to 16 elements
_MIN_CAPABILITY = (8, 0)  # cuDNN's and flash's fused attention need sm_80 or newer
_FLASH_MAX_HEAD_DIM = 256
_CUDNN_MIN_VERSION = 90000
_CUDNN_WIDE_HEADS = (90501, (9, 0), 256)  # cuDNN >= 9.5.1 on sm_90 runs head dims up to 256
_CUDNN_MAX_HEAD_DIM = 128
# The cuDNN ops' argument names (the same in torch 2.11 and 2.13); any other schema is declined, not guessed.
_CUDNN_SCHEMAS = {
    "_scaled_dot_product_cudnn_attention": (
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask", "scale",
    ),
    "_scaled_dot_product_cudnn_attention_backward": (
        "grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias",
        "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale",
    ),
}


class _Call(NamedTuple):
    """The facts of one call that decide its kernel (a NamedTuple: built on every call, so cheap).

    Attributes:
        dtype: q's dtype.
        s_q, s_kv, d_qk, d_v: sequence lengths and head dims.
        mask_type: the config's mask type.
        has_mask, has_bias: whether ``attn_mask`` / ``attn_bias`` were given.
    """

    dtype: torch.dtype
    s_q: int
    s_kv: int
    d_qk: int
    d_v: int
    mask_type: str
    has_mask: bool
    has_bias: bool

    @classmethod
    def of(cls, q, k, v, config: AttentionConfig, attn_mask, attn_bias) -> "_Call":
        return cls(q.dtype, q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], config.mask_type,
                   attn_mask is not None, attn_bias is not None)


class _Device(NamedTuple):
    """What the device offers: compute capability and cuDNN version (0 = no cuDNN)."""

    capability: Tuple[int, int]
    cudnn_version: int

    @classmethod
    def of(cls, device: torch.device) -> "_Device":
        return _device_at(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _device_at(index: int) -> _Device:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return _Device(tuple(torch.cuda.get_device_capability(index)), int(cudnn or 0))


@functools.lru_cache(maxsize=None)
def _cudnn_schema_gap() -> Optional[str]:
    """None if this torch's cuDNN attention ops take the arguments we pass, else why not."""
    for name, expected in _CUDNN_SCHEMAS.items():
        op = getattr(torch.ops.aten, name, None)
        if op is None:
            return f"torch {torch.__version__} has no aten.{name}"
        got = tuple(arg.name for arg in op.default._schema.arguments)
        if got != expected:
            return f"aten.{name} of torch {torch.__version__} takes ({', '.join(got)}), a schema this backend does not know"
    return None


def _cudnn_gap(call: _Call, device: _Device) -> Optional[str]:
    """Why cuDNN cannot run the call (None: it can)."""
    version, capability, limit = _CUDNN_WIDE_HEADS
    max_d = limit if device.cudnn_version >= version and device.capability == capability else _CUDNN_MAX_HEAD_DIM
    if call.dtype not in _HALF:
        return f"dtype {call.dtype}: cuDNN attention runs float16 and bfloat16"
    if call.has_bias:
        return "attn_bias: cuDNN attention returns no bias gradient"
    if call.d_qk % 8 or call.d_v % 8 or max(call.d_qk, call.d_v) > max_d:
        return f"head dims {call.d_qk} / {call.d_v}: cuDNN needs multiples of 8 up to {max_d} here"
    if device.cudnn_version < _CUDNN_MIN_VERSION or tuple(device.capability) < _MIN_CAPABILITY:
        return f"cuDNN {device.cudnn_version} on sm_{device.capability[0]}{device.capability[1]}: needs cuDNN >= 9 and sm_80+"
    return _cudnn_schema_gap()


def _flash_gap(call: _Call, device: _Device) -> Optional[str]:
    """Why FlashAttention-2 cannot run the call (None: it can)."""
    if call.dtype not in _HALF:
        return f"dtype {call.dtype}: flash runs float16 and bfloat16"
    if call.has_mask or call.has_bias:
        return "attn_mask / attn_bias: flash takes neither"
    if call.d_qk != call.d_v or call.d_qk % 8 or call.d_qk > _FLASH_MAX_HEAD_DIM:
        return f"head dims {call.d_qk} / {call.d_v}: flash needs equal multiples of 8 up to {_FLASH_MAX_HEAD_DIM}"
    if tuple(device.capability) < _MIN_CAPABILITY:
        return f"compute capability {device.capability}: flash needs sm_80+"
    return None


@dataclass(frozen=True)
class _Kernel:
    """One SDPA kernel.

    Attributes:
        name: "cudnn", "flash" or "efficient".
        causal_flag: the catalog mask type its causal flag means when s_q != s_kv.
        takes_mask: whether it takes an additive bias (so ``attn_mask`` and folded causal masks).
        causal_with_bias: whether its causal flag is right together with an additive bias (cuDNN's
            backward is not, on torch 2.11 / cuDNN 9.19: the causal mask is then folded into the bias).
        gap: why it cannot run a call (None: it can); the dtype / layout checks of ``SUPPORTS`` come first.
    """

    name: str
    causal_flag: str
    takes_mask: bool
    causal_with_bias: bool
    gap: Callable[[_Call, _Device], Optional[str]]


_KERNELS = (
    _Kernel("cudnn", "causal", takes_mask=True, causal_with_bias=False, gap=_cudnn_gap),
    _Kernel("flash", "causal_bottom_right", takes_mask=False, causal_with_bias=False, gap=_flash_gap),
    _Kernel("efficient", "causal", takes_mask=True, causal_with_bias=True, gap=lambda call, device: None),
)


@dataclass(frozen=True)
class _Plan:
    """Which kernel runs a call and how its mask is expressed.

    Attributes:
        kernel: the kernel's name.
        is_causal: the kernel's causal flag.
        causal_in_bias: the config's causal mask is folded into the additive bias instead.
        passed_over: (kernel, reason) for each faster kernel that could not run the call.
    """

    kernel: str
    is_causal: bool
    causal_in_bias: bool
    passed_over: Tuple[Tuple[str, str], ...] = ()


def _causal_gap(kernel: _Kernel, call: _Call) -> Tuple[Optional[str], bool, bool]:
    """(why the kernel cannot express the causal mask or None, is_causal, causal_in_bias)."""
    if call.mask_type == "no_mask":
        return None, False, False
    native = call.s_q == call.s_kv or (
        call.mask_type == kernel.causal_flag and (call.mask_type == "causal" or call.s_q <= call.s_kv)
    )
    if native and (kernel.causal_with_bias or not (call.has_mask or call.has_bias)):
        return None, True, False
    if kernel.takes_mask:
        return None, False, True
    reason = f"mask_type={call.mask_type!r} with s_q={call.s_q} != s_kv={call.s_kv}: its causal flag means {kernel.causal_flag!r}"
    return reason, False, False


@functools.lru_cache(maxsize=256)
def _plan(call: _Call, device: _Device, kernels: Tuple[_Kernel, ...] = _KERNELS) -> _Plan:
    """The first of ``kernels`` that can run the call (the efficient kernel runs any call SUPPORTS accepts), passing
    over one that would fold the causal mask into a bias the call does not otherwise have (an [s_q, s_kv] bias
    built and read on every call) while a later one expresses the mask with its own flag."""
    passed_over, fallback = [], None
    for kernel in kernels:
        causal_gap, is_causal, causal_in_bias = _causal_gap(kernel, call)
        reason = kernel.gap(call, device) or causal_gap
        if reason is None and causal_in_bias and not (call.has_mask or call.has_bias):
            fallback = fallback or _Plan(kernel.name, is_causal, causal_in_bias, tuple(passed_over))
            reason = f"mask_type={call.mask_type!r} with s_q={call.s_q} != s_kv={call.s_kv}: its causal flag would need a bias"
        if reason is None:
            return _Plan(kernel.name, is_causal, causal_in_bias, tuple(passed_over))
        passed_over.append((kernel.name, reason))
    if fallback is not None:
        return fallback
    raise ValueError(f"no SDPA kernel among {[k.name for k in kernels]} runs this call: {passed_over}")


def _supports_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                  cu_seqlens_kv=None):
    """True, or a Reject naming the argument SDPA cannot take (another backend then runs the call)."""
    if config.qkv_format != "bshd":
        return Reject("qkv_format='thd' (packed sequences): the SDPA kernels take padded bshd batches")
    if config.has_window:
        return Reject(f"window_size={config.window_size}: SDPA has no sliding window")
    if config.bias_type not in ("no_bias", "post_scale_bias"):
        return Reject(f"bias_type={config.bias_type!r}: SDPA adds only a post-scale bias")
    if config.softmax_type != "vanilla":
        return Reject(f"softmax_type={config.softmax_type!r}: SDPA has only the vanilla softmax")
    if q.dtype not in _HALF + (torch.float32,):
        return Reject(f"dtype {q.dtype}: SDPA runs float16, bfloat16 and float32")
    align = 16 // q.element_size()
    if q.shape[-1] % align or v.shape[-1] % align:
        return Reject(f"head dims {q.shape[-1]} / {v.shape[-1]}: the efficient kernel needs multiples of {align} for {q.dtype}")
    if q.device.type != "cuda":
        return Reject(f"inputs are on {q.device.type}, not on a CUDA device")
    return True


def _supports_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                  cu_seqlens_q=None, cu_seqlens_kv=None):
    """Only a ctx made by this backend's forward."""
    return True if isinstance(ctx, SdpaCtx) else Reject("ctx was not made by the vendor.cuda fused_attn_fwd")


SUPPORTS = {"fused_attn_fwd": _supports_fwd, "fused_attn_bwd": _supports_bwd}


@dataclass(frozen=True, eq=False)
class SdpaCtx:
    """What the backward needs from the forward.

    Attributes:
        kernel: the kernel that ran the forward ("cudnn", "flash" or "efficient"); the backward runs its pair.
        config: the forward's AttentionConfig.
        is_causal: the kernel's causal flag.
        saved: the forward op's extra outputs the backward op takes (lse, sequence offsets and
            lengths, rng state).
        bias: the additive bias given to the kernel (None for none).
        dead_rows: bool [b, h or 1, s_q, 1], rows with every key masked (their output is zeroed).
    """

    kernel: str
    config: AttentionConfig
    is_causal: bool
    saved: Tuple
    bias: Optional[torch.Tensor]
    dead_rows: Optional[torch.Tensor]


def _to_heads(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """bshd [b, s, h, d] -> [b, h * group, s, d] (a view unless kv heads are repeated for GQA)."""
    if group > 1:
        x = x.repeat_interleave(group, dim=2)
    return x.transpose(1, 2)


def _from_heads(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """[b, h * group, s, d] -> bshd [b, s, h, d], summing each group of repeated kv heads."""
    x = x.transpose(1, 2)
    return x.unflatten(2, (-1, group)).sum(dim=3) if group > 1 else x


def _in_layout_of(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """x with ``ref``'s strides: the SDPA backward kernels read dO in O's memory layout. A copy only
    when the strides differ (dO of an sbhd layer already has O's layout: O is allocated like q)."""
    if x.stride() == ref.stride():
        return x
    return torch.empty_strided(ref.shape, ref.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _causal_band(s_q: int, s_kv: int, mask_type: str, device) -> torch.Tensor:
    """bool [s_q, s_kv], True where ``mask_type`` masks key j from query i (j > i, or j > i + s_kv - s_q)."""
    shift = s_kv - s_q if mask_type == "causal_bottom_right" else 0
    i = torch.arange(s_q, device=device)[:, None]
    return torch.arange(s_kv, device=device)[None, :] > i + shift


def _kernel_bias(q, k, attn_mask, attn_bias, mask_type: str, fold_causal: bool):
    """(additive bias [b, h, s_q, s_kv] in q's dtype or None, dead rows [b|1, h|1, s_q, 1] or None).

    The bias holds ``attn_bias``, ``attn_mask`` and, if ``fold_causal``, the causal mask of
    ``mask_type``; dead rows are the rows that ``attn_mask`` and the causal mask leave without keys.
    Whether a mask leaves any is not asked (that would wait for the GPU, and a CUDA-graph capture
    forbids it): with ``attn_mask`` the dead rows always come back; the causal band alone has some only
    bottom-right aligned with s_q > s_kv, which the shapes tell.
    """
    b, s_q, h = q.shape[:3]
    s_kv = k.shape[1]
    masked = None if attn_mask is None else attn_mask.to(torch.bool)
    band = None
    if mask_type != "no_mask" and (fold_causal or masked is not None):
        band = _causal_band(s_q, s_kv, mask_type, q.device)
    if masked is None and attn_bias is None and not fold_causal:
        return None, None
    storage = torch.zeros(b, h, s_q, -(-s_kv // _BIAS_ALIGN) * _BIAS_ALIGN, dtype=q.dtype, device=q.device)
    bias = storage[..., :s_kv]
    if attn_bias is not None:
        bias += attn_bias.to(q.dtype)
    hidden = masked if band is None else (band if masked is None else masked | band)
    if hidden is None:
        return bias, None
    bias.masked_fill_(_as_4d(hidden if fold_causal else masked), torch.finfo(q.dtype).min / 2)
    if masked is None and not (mask_type == "causal_bottom_right" and s_q > s_kv):
        return bias, None
    return bias, _as_4d(hidden).all(dim=-1, keepdim=True)


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """x with leading singleton dims up to [b, h, s_q, s_kv] rank."""
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def fused_attn_fwd(q, k, v, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None, cu_seqlens_q=None,
                   cu_seqlens_kv=None):
    """O = dropout(softmax(S)) V on an SDPA kernel (see the module docstring for which one).

    Args:
        q, k, v: bshd CUDA tensors (k, v with h_kv heads, h % h_kv == 0).
        config: :class:`AttentionConfig` (no window, vanilla softmax, no or post-scale bias).
        attn_mask: bool, broadcastable to [b, h, s_q, s_kv], True = masked out.
        attn_bias: post-scale bias broadcastable to [b, h, s_q, s_kv].
        softmax_offset, alibi_slopes, cu_seqlens_q, cu_seqlens_kv: unused (declined when needed).

    Returns:
        (out bshd in q's dtype with v's head dim, :class:`SdpaCtx`).

    Raises:
        ValueError: q, k, v or cu_seqlens not in the layout ``config`` names (the catalog's ``check_attention_layout``).
        NotImplementedError: arguments this backend declines (the dispatcher never sends those).
    """
    check_attention_layout(q, k, v, config, cu_seqlens_q, cu_seqlens_kv)
    verdict = _supports_fwd(q, k, v, config, attn_mask, attn_bias)
    if not verdict:
        raise NotImplementedError(f"vendor.cuda fused_attn_fwd: {verdict.reason}")
    plan = _plan(_Call.of(q, k, v, config, attn_mask, attn_bias), _Device.of(q.device))
    return _forward(q, k, v, config, attn_mask, attn_bias, plan)


def _forward(q, k, v, config: AttentionConfig, attn_mask, attn_bias, plan: _Plan):
    """Run the planned kernel: (out bshd, SdpaCtx)."""
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = _to_heads(q), _to_heads(k, group), _to_heads(v, group)
    scale, p = config.softmax_scale, config.dropout_p
    bias, dead = None, None
    if plan.kernel != "flash":
        bias, dead = _kernel_bias(q, k, attn_mask, attn_bias, config.mask_type, plan.causal_in_bias)
    if plan.kernel == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, bias, compute_log_sumexp=True, dropout_p=p,
                                                                 is_causal=plan.is_causal, return_debug_mask=False, scale=scale)
        out_h, saved = res[0], tuple(res[1:8])
    elif plan.kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, p, plan.is_causal, return_debug_mask=False, scale=scale)
        out_h, saved = res[0], tuple(res[1:8])
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, bias, compute_log_sumexp=True, dropout_p=p,
                                                                     is_causal=plan.is_causal, scale=scale)
        out_h, saved = res[0], tuple(res[1:4])
    out = _from_heads(out_h)
    if dead is not None:
        out = out.masked_fill(dead.transpose(1, 2), 0.0)
    return out, SdpaCtx(plan.kernel, config, plan.is_causal, saved, bias, dead)


def fused_attn_bwd(dout, q, k, v, out, ctx, config, attn_mask=None, attn_bias=None, softmax_offset=None, alibi_slopes=None,
                   cu_seqlens_q=None, cu_seqlens_kv=None):
    """Gradients of :func:`fused_attn_fwd` on the kernel that ran it.

    Args:
        dout: dO, bshd like ``out``.
        q, k, v, out, config and the optional tensors: as given to / returned by the forward.
        ctx: the forward's :class:`SdpaCtx`.

    Returns:
        (dq, dk, dv, dbias reduced to attn_bias's shape or None, None).

    Raises:
        ValueError: ctx from another backend or another config.
    """
    if not isinstance(ctx, SdpaCtx) or ctx.config != config:
        raise ValueError("ctx must come from the vendor.cuda fused_attn_fwd called with the same config")
    group = q.shape[2] // k.shape[2]
    if ctx.dead_rows is not None:
        dout = dout.masked_fill(ctx.dead_rows.transpose(1, 2), 0.0)
    qh, kh, vh = _to_heads(q), _to_heads(k, group), _to_heads(v, group)
    outh = _to_heads(out)
    doh = _in_layout_of(_to_heads(dout), outh)
    scale, p = config.softmax_scale, config.dropout_p
    dbias = None
    if ctx.kernel == "cudnn":
        lse, cum_q, cum_k, max_q, max_k, seed, offset = ctx.saved
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            doh, qh, kh, vh, outh, lse, seed, offset, ctx.bias, cum_q, cum_k, max_q, max_k, p, ctx.is_causal, scale=scale
        )
    elif ctx.kernel == "flash":
        lse, cum_q, cum_k, max_q, max_k, seed, offset = ctx.saved
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, outh, lse, cum_q, cum_k, max_q, max_k, p, ctx.is_causal, seed, offset, scale=scale
        )
    else:
        lse, seed, offset = ctx.saved
        want_dbias = attn_bias is not None
        dq, dk, dv, dbias = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, ctx.bias, outh, lse, seed, offset, p, [True, True, True, want_dbias], ctx.is_causal, scale=scale
        )
        dbias = _reduce_to(dbias, attn_bias) if want_dbias else None
    return _from_heads(dq), _from_heads(dk, group), _from_heads(dv, group), dbias, None


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """grad [b, h, s_q, s_kv] summed over the dims where ``like`` broadcasts, in ``like``'s shape and dtype."""
    shape = (1,) * (4 - like.dim()) + tuple(like.shape)
    dims = tuple(d for d in range(4) if shape[d] == 1 and grad.shape[d] != 1)
    grad = grad.sum(dim=dims, keepdim=True) if dims else grad
    return grad.reshape(like.shape).to(like.dtype)


#: These kernels are the ones PyTorch's ``scaled_dot_product_attention`` runs (torch 2.11 picks cuDNN first on sm_90, as
#: ``_KERNELS`` does; measured in docs/performance.md): a module may run a call that SDPA expresses (no bias, window or
#: extra mask, square if causal) as SDPA itself, with PyTorch's autograd (pytorch/attention/dot_product_attention.py).
ATEN_DTYPES = {"fused_attn_fwd": (torch.float32, *_HALF), "fused_attn_bwd": (torch.float32, *_HALF)}
