"""FP8 attention on cuDNN's FP8 SDPA graphs (the kernels NVIDIA TE's ``fp8_dpa`` runs), through cudnn-frontend's Python API.

Needs the optional ``nvidia-cudnn-frontend`` package (``pip install transformer_engine[cudnn]``), which drives the cuDNN
library PyTorch loads. One forward and one backward graph per problem (shapes, strides, dtypes, mask, softmax scale,
device) are built at first use (about 2-3 s each on an H100) and kept; a call then costs one ``execute`` (some 35 us of
host time). ``SUPPORTS`` declines, naming the reason, whatever cuDNN cannot build here: the package or a GPU of compute
capability 9.0 missing, or cuDNN's own refusal (on sm_90 with cuDNN 9.19: head sizes other than 128, which the
reference backend then runs). Measured on an H100 (docs/performance.md, "What cuDNN's FP8 attention gives on Hopper"):
1.34-1.39x faster than bf16 attention forward + backward at s = 4096-8192, d = 128, but 1.19x slower at s = 2048 causal.
cuDNN's math is the catalog's with online-softmax tiles (P8 relative to the running row maximum), so results match the
reference backend to FP8 accuracy, not bit for bit.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch

from transformer_engine.plugin.catalog.attention_fp8 import fp8_attention_error
from transformer_engine.plugin.core import Reject

__all__ = ["fused_attn_fp8_fwd", "fused_attn_fp8_bwd"]

_SCALAR = ((1, 1, 1, 1), (1, 1, 1, 1))
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=None)
def _cudnn() -> Union[Any, str]:
    """The ``cudnn`` module of cudnn-frontend, or why it cannot be used."""
    try:
        import cudnn
    except ImportError as exc:
        return f"cudnn-frontend is not installed (pip install nvidia-cudnn-frontend): {exc}"
    if not hasattr(cudnn, "pygraph"):
        return f"cudnn-frontend {getattr(cudnn, '__version__', '?')} has no pygraph API"
    return cudnn


@dataclass(frozen=True)
class _Problem:
    """What a graph is built for: the logical [b, h, s, d] dims and strides of q, k, v and the outputs."""

    q: Tuple[Tuple[int, ...], Tuple[int, ...]]
    kv: Tuple[Tuple[int, ...], Tuple[int, ...]]
    fwd_dtype: torch.dtype
    bwd_dtype: Optional[torch.dtype]  # None: the forward graph
    causal: bool
    softmax_scale: float
    device: int


def _bhsd(t: torch.Tensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(dims, strides) of a [b, s, h, d] tensor in cuDNN's logical [b, h, s, d] order."""
    b, s, h, d = t.shape
    return (b, h, s, d), (t.stride(0), t.stride(2), t.stride(1), t.stride(3))


def _contiguous_bhsd(dims: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(dims, strides) of a contiguous [b, s, h, d] tensor of logical dims [b, h, s, d]."""
    b, h, s, d = dims
    return dims, (s * h * d, d, h * d, 1)


class _Graphs:
    """Built graphs per problem (a failure is kept as its message), the handle and the workspace per device."""

    def __init__(self):
        self._lock = threading.Lock()
        self._built: Dict[_Problem, Union[Any, str]] = {}
        self._handles: Dict[int, Any] = {}
        self._workspace: Dict[int, torch.Tensor] = {}

    def get(self, problem: _Problem) -> Union[Any, str]:
        graph = self._built.get(problem)
        if graph is None:
            with self._lock:
                graph = self._built.get(problem)
                if graph is None:
                    graph = self._built[problem] = _build(problem)
        return graph

    def execute(self, graph, device: torch.device, pack: Dict[int, torch.Tensor]) -> None:
        cudnn = _cudnn()
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = self._handles.get(index)
        if handle is None:
            with torch.cuda.device(index):
                handle = self._handles[index] = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
        workspace = self._workspace.get(index)
        size = graph.get_workspace_size()
        if workspace is None or workspace.numel() < size:
            workspace = self._workspace[index] = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        graph.execute(pack, workspace, handle=handle)


_GRAPHS = _Graphs()


def _cudnn_type(cudnn, dtype: torch.dtype):
    return {torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3, torch.float8_e5m2: cudnn.data_type.FP8_E5M2}[dtype]


def _scalars(graph, uids) -> list:
    cudnn = _cudnn()
    return [graph.tensor(uid=uid, dim=_SCALAR[0], stride=_SCALAR[1], data_type=cudnn.data_type.FLOAT) for uid in uids]


def _set_output(tensor, uid: int, layout: Tuple[Tuple[int, ...], Tuple[int, ...]], data_type) -> None:
    tensor.set_uid(uid).set_output(True).set_dim(layout[0]).set_stride(layout[1]).set_data_type(data_type)


# variant-pack uids: inputs, scales, outputs
_Q, _K, _V, _O, _STATS, _DO = 1, 2, 3, 4, 5, 6
_DESCALE_QKV, _DESCALE_S, _SCALE_S, _SCALE_O, _DESCALE_O, _DESCALE_DO, _DESCALE_DP, _SCALE_DP, _SCALE_DQKV = range(10, 19)
_AMAX_S, _AMAX_O, _DQ, _DK, _DV, _AMAX_DQ, _AMAX_DK, _AMAX_DV, _AMAX_DP = range(20, 29)


def _build(problem: _Problem) -> Union[Any, str]:
    """The built forward (``bwd_dtype`` None) or backward graph of ``problem``, or the reason there is none (the GPU's
    compute capability, or cuDNN's refusal)."""
    capability = torch.cuda.get_device_capability(problem.device)
    if capability < (9, 0):
        return f"cuDNN's FP8 attention needs compute capability 9.0 or newer, this GPU has {capability}"
    cudnn = _cudnn()
    fp8 = _cudnn_type(cudnn, problem.fwd_dtype)
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT)
    q = graph.tensor(uid=_Q, dim=problem.q[0], stride=problem.q[1], data_type=fp8)
    k, v = (graph.tensor(uid=uid, dim=problem.kv[0], stride=problem.kv[1], data_type=fp8) for uid in (_K, _V))
    stats_layout = ((*problem.q[0][:3], 1), (problem.q[0][1] * problem.q[0][2], problem.q[0][2], 1, 1))
    o_layout = _contiguous_bhsd(problem.q[0])
    float32 = cudnn.data_type.FLOAT
    try:
        if problem.bwd_dtype is None:
            descale, descale_s, scale_s, scale_o = _scalars(graph, (_DESCALE_QKV, _DESCALE_S, _SCALE_S, _SCALE_O))
            o, stats, amax_s, amax_o = graph.sdpa_fp8(
                q=q, k=k, v=v, descale_q=descale, descale_k=descale, descale_v=descale, descale_s=descale_s, scale_s=scale_s,
                scale_o=scale_o, generate_stats=True, attn_scale=problem.softmax_scale, use_causal_mask=problem.causal)
            _set_output(o, _O, o_layout, fp8)
            _set_output(stats, _STATS, stats_layout, float32)
            for amax, uid in ((amax_s, _AMAX_S), (amax_o, _AMAX_O)):
                _set_output(amax, uid, _SCALAR, float32)
        else:
            grad = _cudnn_type(cudnn, problem.bwd_dtype)
            o = graph.tensor(uid=_O, dim=o_layout[0], stride=o_layout[1], data_type=fp8)
            do = graph.tensor(uid=_DO, dim=o_layout[0], stride=o_layout[1], data_type=grad)
            stats = graph.tensor(uid=_STATS, dim=stats_layout[0], stride=stats_layout[1], data_type=float32)
            descale, descale_o, descale_do, descale_s, descale_dp, scale_s, scale_dp, scale_dqkv = _scalars(
                graph, (_DESCALE_QKV, _DESCALE_O, _DESCALE_DO, _DESCALE_S, _DESCALE_DP, _SCALE_S, _SCALE_DP, _SCALE_DQKV))
            dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = graph.sdpa_fp8_backward(
                q=q, k=k, v=v, o=o, dO=do, stats=stats, descale_q=descale, descale_k=descale, descale_v=descale,
                descale_o=descale_o, descale_dO=descale_do, descale_s=descale_s, descale_dP=descale_dp, scale_s=scale_s,
                scale_dQ=scale_dqkv, scale_dK=scale_dqkv, scale_dV=scale_dqkv, scale_dP=scale_dp,
                attn_scale=problem.softmax_scale, use_causal_mask=problem.causal)
            _set_output(dq, _DQ, o_layout, grad)
            for t, uid in ((dk, _DK), (dv, _DV)):
                _set_output(t, uid, _contiguous_bhsd(problem.kv[0]), grad)
            for amax, uid in ((amax_dq, _AMAX_DQ), (amax_dk, _AMAX_DK), (amax_dv, _AMAX_DV), (amax_dp, _AMAX_DP)):
                _set_output(amax, uid, _SCALAR, float32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as exc:  # noqa: BLE001 - cuDNN's refusal is the reason the call is declined
        return f"cuDNN {cudnn.backend_version()} cannot build this FP8 attention graph: {type(exc).__name__}: {exc}"
    return graph


def _problem(q, k, config, bwd_dtype: Optional[torch.dtype]) -> _Problem:
    return _Problem(_bhsd(q), _bhsd(k), q.dtype, bwd_dtype, config.mask_type == "causal", float(config.softmax_scale),
                    q.device.index if q.device.index is not None else torch.cuda.current_device())


def _gap(q, k, v, config, bwd_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why this backend does not run the call, or None."""
    error = fp8_attention_error(q, k, v, config)
    if error:
        return error
    if q.dtype not in _FP8 or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must share one FP8 dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.device.type != "cuda":
        return f"inputs are on {q.device.type}, not on a CUDA device"
    cudnn = _cudnn()
    if isinstance(cudnn, str):
        return cudnn
    if k.stride() != v.stride():
        return "k and v must have one memory layout"
    graph = _GRAPHS.get(_problem(q, k, config, bwd_dtype))
    return graph if isinstance(graph, str) else None


def _supports_fwd(q, k, v, qkv_scale_inv, s_scale, o_scale, config):
    gap = _gap(q, k, v, config, None)
    return True if gap is None else Reject(gap)


def _supports_bwd(dout, q, k, v, out, stats, qkv_scale_inv, out_scale_inv, dout_scale_inv, s_scale, dp_scale, dqkv_scale, config):
    if dout.dtype not in _FP8 or out.dtype != q.dtype:
        return Reject(f"dout must be FP8 and out of q's dtype, got {dout.dtype}, {out.dtype}")
    if not (out.is_contiguous() and dout.is_contiguous() and out.shape == q.shape and dout.shape == q.shape):
        return Reject("out and dout must be contiguous with q's shape")
    gap = _gap(q, k, v, config, dout.dtype)
    return True if gap is None else Reject(gap)


SUPPORTS = {"fused_attn_fp8_fwd": _supports_fwd, "fused_attn_fp8_bwd": _supports_bwd}


def _amax(device) -> torch.Tensor:
    return torch.empty((), dtype=torch.float32, device=device)


def fused_attn_fp8_fwd(q, k, v, qkv_scale_inv, s_scale, o_scale, config):
    """See plugin/catalog/attention_fp8.py (cuDNN's ``sdpa_fp8``)."""
    graph = _GRAPHS.get(_problem(q, k, config, None))
    if isinstance(graph, str):
        raise ValueError(graph)
    b, s, h, d = q.shape
    o = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
    stats = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    amax_s, amax_o = _amax(q.device), _amax(q.device)
    _GRAPHS.execute(graph, q.device, {
        _Q: q, _K: k, _V: v, _DESCALE_QKV: qkv_scale_inv, _DESCALE_S: torch.reciprocal(s_scale), _SCALE_S: s_scale,
        _SCALE_O: o_scale, _O: o, _STATS: stats, _AMAX_S: amax_s, _AMAX_O: amax_o,
    })
    # cuDNN quantizes the tiles' exp(S - running max) <= 1 with s_scale, but reports the amax of the normalized
    # probabilities (0.05 for 4096 unmasked keys, measured): fed to delayed scaling, that scale would saturate P. The
    # catalog's amax_s is the amax of what is quantized: 1 wherever a row has an unmasked key (every call accepted here).
    return o, stats, torch.ones((), dtype=torch.float32, device=q.device), amax_o


def fused_attn_fp8_bwd(dout, q, k, v, out, stats, qkv_scale_inv, out_scale_inv, dout_scale_inv, s_scale, dp_scale, dqkv_scale,
                       config):
    """See plugin/catalog/attention_fp8.py (cuDNN's ``sdpa_fp8_backward``)."""
    graph = _GRAPHS.get(_problem(q, k, config, dout.dtype))
    if isinstance(graph, str):
        raise ValueError(graph)
    dq = torch.empty(q.shape, dtype=dout.dtype, device=q.device)
    dk, dv = (torch.empty(k.shape, dtype=dout.dtype, device=q.device) for _ in range(2))
    amaxes = [_amax(q.device) for _ in range(4)]
    _GRAPHS.execute(graph, q.device, {
        _Q: q, _K: k, _V: v, _O: out, _DO: dout, _STATS: stats, _DESCALE_QKV: qkv_scale_inv, _DESCALE_O: out_scale_inv,
        _DESCALE_DO: dout_scale_inv, _DESCALE_S: torch.reciprocal(s_scale), _DESCALE_DP: torch.reciprocal(dp_scale),
        _SCALE_S: s_scale, _SCALE_DP: dp_scale, _SCALE_DQKV: dqkv_scale, _DQ: dq, _DK: dk, _DV: dv,
        _AMAX_DQ: amaxes[0], _AMAX_DK: amaxes[1], _AMAX_DV: amaxes[2], _AMAX_DP: amaxes[3],
    })
    return dq, dk, dv, torch.maximum(torch.maximum(amaxes[0], amaxes[1]), amaxes[2]), amaxes[3]
