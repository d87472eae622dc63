"""Memory-bound kernels on the GPU: flagos (Triton) vs reference vs plain PyTorch, in GB/s.

Bytes model: every kernel must read each input once and write each output once; ``Case.nbytes``
counts exactly that from the shapes and dtypes (statistics, weights and scales included, L2 hits
not subtracted). GB/s = nbytes / median time; "of copy" divides by the device-to-device copy
bandwidth measured in the same run (2 x bytes / time of ``dst.copy_(src)`` on 1 GiB). PERF.md's
target for the fused norm / activation / cast-transpose kernels is >= 0.8 of copy.

Provider ``flag_gems`` (the optional FlagGems package, when importable) runs the ``torch``
formulation with FlagGems' Triton kernels in place of PyTorch's aten kernels (``flag_gems.use_gems()``),
for the cases whose aten ops FlagGems implements (norms, GELU / SiLU, softmax, dropout, cross entropy);
its first output is checked against the reference too.

Timing: ``triton.testing.do_bench`` median (it flushes L2 before every iteration); on top of that
each case rotates over enough input sets to exceed twice the L2 size. Providers: ``flagos`` and
``reference`` call the backends' functions directly (no dispatch), ``torch`` is the closest plain
PyTorch formulation (eager, no TE-FL code). Before timing, flagos' first output is compared with the
reference's (relative L2 error, FP8 outputs dequantized), so a fast wrong kernel shows; random ops
(dropout) are compared with their formula evaluated with flagos' own keep mask instead.

    python benchmarks/bench_kernels.py --json kernels.json                  # H200, everything
    python benchmarks/bench_kernels.py --only norm,swiglu --providers flagos,torch
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.testing

from _harness import print_table, write_json

PROVIDERS = ("flagos", "reference", "torch", "flag_gems")
E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
_L2_BYTES = 60 * 2**20  # H200: 60 MB (PERF.md); rotation covers twice this
_MAX_SETS = 8


@dataclass(frozen=True)
class Case:
    """One kernel at one shape.

    Attributes:
        name: op name (plus a suffix for a variant, e.g. "layernorm_fwd+fp8").
        shape: human-readable shape and dtype.
        nbytes: ideal bytes moved by one call (inputs read once, outputs written once).
        make: builds one fresh input set (a tuple of arguments) on the GPU.
        fns: provider -> function taking the arguments of ``make``.
        expected: for random ops, (arguments, flagos' result) -> the expected first output, the
            formula with flagos' own draw (the reference would draw another mask); None: the reference.
    """

    name: str
    shape: str
    nbytes: int
    make: Callable[[], tuple]
    fns: Dict[str, Callable]
    expected: Optional[Callable] = None


def _nbytes(*tensors_or_counts) -> int:
    """Bytes of tensors, or (numel, dtype) pairs."""
    total = 0
    for item in tensors_or_counts:
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        else:
            numel, dtype = item
            total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def _backends(family: str):
    flagos = importlib.import_module(f"transformer_engine.plugin.backends.flagos.{family}")
    reference = importlib.import_module(f"transformer_engine.plugin.backends.reference.{family}")
    return flagos, reference


def _torch_quantize(x, scale):
    """Plain PyTorch per-tensor cast: clip(x * scale) -> E4M3, 1 / scale, amax."""
    q = (x.float() * scale).clamp(-448.0, 448.0).to(E4M3)
    return q, scale.reciprocal(), x.abs().amax().float()


def _torch_cast_transpose(x, scale):
    q, scale_inv, amax = _torch_quantize(x, scale)
    return q, q.view(torch.uint8).t().contiguous(), scale_inv, amax


def _torch_cast_transpose_dbias(x, scale):
    return _torch_cast_transpose(x, scale) + (x.sum(dim=0, dtype=torch.float32),)


def norm_cases(m: int = 16384, h: int = 4096) -> List[Case]:
    """LayerNorm / RMSNorm fwd, fwd+FP8 and bwd at PERF.md's [16384, 4096] bf16."""
    fn, ref = _backends("normalization")
    eps, scale = 1e-5, torch.tensor([2.0], device="cuda")

    def make_fwd():
        return torch.randn(m, h, device="cuda", dtype=BF16), torch.randn(h, device="cuda", dtype=BF16), torch.randn(h, device="cuda",
                                                                                                                    dtype=BF16)

    def make_bwd():
        x, w, b = make_fwd()
        _, mean, rstd, _, _ = ref.layernorm_fwd(x, w, b, eps)
        return torch.randn_like(x), x, mean, rstd, w

    stats = (2 * m, torch.float32)
    io = _nbytes((m * h, BF16), (m * h, BF16), (2 * h, BF16), stats)
    io_fp8 = _nbytes((m * h, BF16), (m * h, E4M3), (2 * h, BF16), stats)
    io_bwd = _nbytes((3 * m * h, BF16), (3 * h, BF16), stats)
    shape = f"[{m}, {h}] bf16"
    ln_bwd_torch = lambda dy, x, mean, rstd, w: torch.ops.aten.native_layer_norm_backward(  # noqa: E731
        dy, x, [h], mean[:, None], rstd[:, None], w, w, [True, True, True])
    return [
        Case("layernorm_fwd", shape, io, make_fwd, {
            "flagos": lambda x, w, b: fn.layernorm_fwd(x, w, b, eps), "reference": lambda x, w, b: ref.layernorm_fwd(x, w, b, eps),
            "torch": lambda x, w, b: F.layer_norm(x, (h,), w, b, eps)}),
        Case("layernorm_fwd+fp8", shape, io_fp8, make_fwd, {
            "flagos": lambda x, w, b: fn.layernorm_fwd(x, w, b, eps, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=E4M3),
            "reference": lambda x, w, b: ref.layernorm_fwd(x, w, b, eps, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=E4M3),
            "torch": lambda x, w, b: _torch_quantize(F.layer_norm(x, (h,), w, b, eps), scale)}),
        Case("layernorm_bwd", shape, io_bwd, make_bwd, {
            "flagos": fn.layernorm_bwd, "reference": ref.layernorm_bwd, "torch": ln_bwd_torch}),
        Case("rmsnorm_fwd", shape, io - _nbytes((h, BF16), (m, torch.float32)), make_fwd, {
            "flagos": lambda x, w, b: fn.rmsnorm_fwd(x, w, eps), "reference": lambda x, w, b: ref.rmsnorm_fwd(x, w, eps),
            "torch": lambda x, w, b: F.rms_norm(x, (h,), w, eps)}),
        Case("rmsnorm_fwd+fp8", shape, io_fp8 - _nbytes((h, BF16), (m, torch.float32)), make_fwd, {
            "flagos": lambda x, w, b: fn.rmsnorm_fwd(x, w, eps, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=E4M3),
            "reference": lambda x, w, b: ref.rmsnorm_fwd(x, w, eps, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=E4M3),
            "torch": lambda x, w, b: _torch_quantize(F.rms_norm(x, (h,), w, eps), scale)}),
        Case("rmsnorm_bwd", shape, io_bwd - _nbytes((h, BF16), (m, torch.float32)), make_bwd, {
            "flagos": lambda dy, x, mean, rstd, w: fn.rmsnorm_bwd(dy, x, rstd, w),
            "reference": lambda dy, x, mean, rstd, w: ref.rmsnorm_bwd(dy, x, rstd, w)}),
    ]  # fmt: skip


def _torch_dswiglu(dy, x):
    a, b = x.float().chunk(2, dim=-1)
    s = torch.sigmoid(a)
    return torch.cat([dy * b * (s + a * s * (1 - s)), dy * a * s], dim=-1).to(x.dtype)


def activation_cases(m: int = 8192, f: int = 8192) -> List[Case]:
    """GELU and SwiGLU fwd / bwd, and SwiGLU fused with the FP8 cast, bf16."""
    fa, ref = _backends("activation")
    scale = torch.tensor([2.0], device="cuda")
    make_plain = lambda: (torch.randn(m, f, device="cuda", dtype=BF16),)  # noqa: E731
    make_gated = lambda: (torch.randn(m, 2 * f, device="cuda", dtype=BF16),)  # noqa: E731
    make_plain_bwd = lambda: (torch.randn(m, f, device="cuda", dtype=BF16),) + make_plain()  # noqa: E731
    make_gated_bwd = lambda: (torch.randn(m, f, device="cuda", dtype=BF16),) + make_gated()  # noqa: E731
    mf = m * f
    return [
        Case("gelu", f"[{m}, {f}] bf16", _nbytes((2 * mf, BF16)), make_plain, {
            "flagos": fa.gelu, "reference": ref.gelu, "torch": lambda x: F.gelu(x, approximate="tanh")}),
        Case("dgelu", f"[{m}, {f}] bf16", _nbytes((3 * mf, BF16)), make_plain_bwd, {
            "flagos": fa.dgelu, "reference": ref.dgelu,
            "torch": lambda dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh")}),
        Case("swiglu", f"[{m}, 2x{f}] bf16", _nbytes((3 * mf, BF16)), make_gated, {
            "flagos": fa.swiglu, "reference": ref.swiglu, "torch": lambda x: F.silu(x[:, :f]) * x[:, f:]}),
        Case("dswiglu", f"[{m}, 2x{f}] bf16", _nbytes((5 * mf, BF16)), make_gated_bwd, {
            "flagos": fa.dswiglu, "reference": ref.dswiglu, "torch": _torch_dswiglu}),
        Case("activation_quantize(swiglu)", f"[{m}, 2x{f}] bf16", _nbytes((2 * mf, BF16), (mf, E4M3)), make_gated, {
            "flagos": lambda x: fa.activation_quantize(x, "swiglu", scale, E4M3),
            "reference": lambda x: ref.activation_quantize(x, "swiglu", scale, E4M3),
            "torch": lambda x: _torch_quantize(F.silu(x[:, :f]) * x[:, f:], scale)}),
    ]  # fmt: skip


def quantization_cases(m: int = 16384, n: int = 4096) -> List[Case]:
    """Per-tensor FP8 casts of a [16384, 4096] bf16 tensor."""
    fq, ref = _backends("quantization")
    fqb = importlib.import_module("transformer_engine.plugin.backends.flagos.quantization_blockwise")  # flagos: a module of their own
    scale = torch.tensor([2.0], device="cuda")
    make_x = lambda: (torch.randn(m, n, device="cuda", dtype=BF16),)  # noqa: E731
    make_q = lambda: (torch.randn(m, n, device="cuda").to(E4M3),)  # noqa: E731
    mn, shape, F32 = m * n, f"[{m}, {n}]", torch.float32
    return [
        Case("quantize", shape + " bf16", _nbytes((mn, BF16), (mn, E4M3)), make_x, {
            "flagos": lambda x: fq.quantize(x, scale, E4M3), "reference": lambda x: ref.quantize(x, scale, E4M3),
            "torch": lambda x: _torch_quantize(x, scale)}),
        Case("cast_transpose", shape + " bf16", _nbytes((mn, BF16), (2 * mn, E4M3)), make_x, {
            "flagos": lambda x: fq.cast_transpose(x, scale, E4M3), "reference": lambda x: ref.cast_transpose(x, scale, E4M3),
            "torch": lambda x: _torch_cast_transpose(x, scale)}),
        Case("cast_transpose_dbias", shape + " bf16", _nbytes((mn, BF16), (2 * mn, E4M3), (n, torch.float32)), make_x, {
            "flagos": lambda x: fq.cast_transpose_dbias(x, scale, E4M3),
            "reference": lambda x: ref.cast_transpose_dbias(x, scale, E4M3),
            "torch": lambda x: _torch_cast_transpose_dbias(x, scale)}),
        Case("fp8_transpose", shape + " e4m3", _nbytes((2 * mn, E4M3)), make_q, {
            "flagos": fq.fp8_transpose, "reference": ref.fp8_transpose,
            "torch": lambda q: q.view(torch.uint8).t().contiguous()}),
        Case("dequantize", shape + " e4m3->bf16", _nbytes((mn, E4M3), (mn, BF16)), make_q, {
            "flagos": lambda q: fq.dequantize(q, scale, BF16), "reference": lambda q: ref.dequantize(q, scale, BF16),
            "torch": lambda q: (q.float() * scale).to(BF16)}),
        Case("compute_amax", shape + " bf16", _nbytes((mn, BF16)), make_x, {
            "flagos": fq.compute_amax, "reference": ref.compute_amax, "torch": lambda x: x.abs().amax()}),
        Case("quantize_blockwise(1x128)", shape + " bf16", _nbytes((mn, BF16), (mn, E4M3), (mn // 128, F32)), make_x, {
            "flagos": lambda x: fqb.quantize_blockwise(x, E4M3, 1, 128, power_2_scale=True, amax_epsilon=0.0),
            "reference": lambda x: ref.quantize_blockwise(x, E4M3, 1, 128, power_2_scale=True, amax_epsilon=0.0)}),
        Case("cast_transpose_blockwise(128)", shape + " bf16", _nbytes((mn, BF16), (2 * mn, E4M3), (2 * mn // 128, F32)), make_x, {
            "flagos": lambda x: fqb.cast_transpose_blockwise(x, E4M3, 128, power_2_scale=True, amax_epsilon=0.0),
            "reference": lambda x: ref.cast_transpose_blockwise(x, E4M3, 128, power_2_scale=True, amax_epsilon=0.0)}),
    ]  # fmt: skip


def softmax_cases(b: int = 4, h: int = 32, s: int = 1024) -> List[Case]:
    """Scaled and aligned-causal softmax fwd, softmax bwd, [4, 32, 1024, 1024] bf16."""
    fs, ref = _backends("softmax")
    make_x = lambda: (torch.randn(b, h, s, s, device="cuda", dtype=BF16),)  # noqa: E731
    make_bwd = lambda: (torch.randn(b, h, s, s, device="cuda", dtype=BF16), torch.softmax(make_x()[0].float(), -1).to(BF16))  # noqa: E731
    numel, shape = b * h * s * s, f"[{b}, {h}, {s}, {s}] bf16"
    torch_bwd = lambda dy, y: 0.5 * torch._softmax_backward_data(dy, y, -1, BF16)  # noqa: E731
    return [
        Case("scaled_softmax_forward", shape, _nbytes((2 * numel, BF16)), make_x, {
            "flagos": lambda x: fs.scaled_softmax_forward(x, 0.5), "reference": lambda x: ref.scaled_softmax_forward(x, 0.5),
            "torch": lambda x: torch.softmax(x * 0.5, dim=-1)}),
        Case("scaled_aligned_causal_masked_softmax_forward", shape, _nbytes((2 * numel, BF16)), make_x, {
            "flagos": lambda x: fs.scaled_aligned_causal_masked_softmax_forward(x, 0.5),
            "reference": lambda x: ref.scaled_aligned_causal_masked_softmax_forward(x, 0.5)}),
        Case("scaled_softmax_backward", shape, _nbytes((3 * numel, BF16)), make_bwd, {
            "flagos": lambda dy, y: fs.scaled_softmax_backward(dy, y, 0.5),
            "reference": lambda dy, y: ref.scaled_softmax_backward(dy, y, 0.5), "torch": torch_bwd}),
    ]  # fmt: skip


def _torch_rope(t, cos, sin):
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def misc_cases() -> List[Case]:
    """RoPE [4096, 4, 32, 128] bf16 sbhd, and cross entropy over [8192, 32768] bf16 logits."""
    fr, ref_rope = _backends("rope")
    fm, ref_misc = _backends("misc")
    s, b, h, d, n, v = 4096, 4, 32, 128, 8192, 32768
    freqs = torch.randn(s, 1, 1, d, device="cuda")
    cos, sin = freqs.cos().to(BF16), freqs.sin().to(BF16)
    make_t = lambda: (torch.randn(s, b, h, d, device="cuda", dtype=BF16),)  # noqa: E731
    make_z = lambda: (torch.randn(n, v, device="cuda", dtype=BF16), torch.randint(0, v, (n,), device="cuda"))  # noqa: E731

    def make_z_bwd():
        z, target = make_z()
        return torch.randn(n, device="cuda"), z, target, ref_misc.cross_entropy_fwd(z, target)[1]

    return [
        Case("fused_rope_forward", f"[{s}, {b}, {h}, {d}] bf16", _nbytes((2 * s * b * h * d, BF16), freqs), make_t, {
            "flagos": lambda t: fr.fused_rope_forward(t, freqs), "reference": lambda t: ref_rope.fused_rope_forward(t, freqs),
            "torch": lambda t: _torch_rope(t, cos, sin)}),
        Case("cross_entropy_fwd", f"[{n}, {v}] bf16", _nbytes((n * v, BF16), (n, torch.int64), (2 * n, torch.float32)), make_z, {
            "flagos": fm.cross_entropy_fwd, "reference": ref_misc.cross_entropy_fwd,
            "torch": lambda z, t: F.cross_entropy(z, t, reduction="none")}),
        Case("cross_entropy_bwd", f"[{n}, {v}] bf16", _nbytes((2 * n * v, BF16), (n, torch.int64), (2 * n, torch.float32)),
             make_z_bwd, {"flagos": fm.cross_entropy_bwd, "reference": ref_misc.cross_entropy_bwd}),
    ]  # fmt: skip


def optimizer_cases() -> List[Case]:
    """Adam / scale / L2 norm over 48 fp32 tensors (~250M elements, odd sizes included)."""
    fo, ref = _backends("optimizer")
    sizes = [(4096, 1024)] * 40 + [(11008, 4096)] * 2 + [(4097,), (17,), (3, 1021)] * 2
    numel = sum(math.prod(sz) for sz in sizes)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    make_lists = lambda k: tuple([torch.rand(sz, device="cuda") for sz in sizes] for _ in range(k))  # noqa: E731
    adam = (1e-3, 0.9, 0.999, 1e-8, 5, 1, True, 0.01)
    steps = [torch.tensor(5.0, device="cuda") for _ in sizes]

    def torch_adam(g, p, m, v):  # what torch.optim.AdamW(fused=True) launches
        torch._fused_adamw_(p, g, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False)  # fmt: skip

    return [
        Case("multi_tensor_adam", f"{len(sizes)} tensors, {numel / 1e6:.0f}M fp32", _nbytes((7 * numel, torch.float32)),
             lambda: make_lists(4), {
                 "flagos": lambda *lists: fo.multi_tensor_adam(65536, flag, list(lists), *adam),
                 "reference": lambda *lists: ref.multi_tensor_adam(65536, flag, list(lists), *adam), "torch": torch_adam}),
        Case("multi_tensor_scale", f"{len(sizes)} tensors, {numel / 1e6:.0f}M fp32", _nbytes((2 * numel, torch.float32)),
             lambda: make_lists(2), {
                 "flagos": lambda i, o: fo.multi_tensor_scale(65536, flag, [i, o], 0.5),
                 "reference": lambda i, o: ref.multi_tensor_scale(65536, flag, [i, o], 0.5),
                 "torch": lambda i, o: torch._foreach_mul(i, 0.5)}),
        Case("multi_tensor_l2norm", f"{len(sizes)} tensors, {numel / 1e6:.0f}M fp32", _nbytes((numel, torch.float32)),
             lambda: make_lists(1), {
                 "flagos": lambda t: fo.multi_tensor_l2norm(65536, flag, [t], per_tensor=True),
                 "reference": lambda t: ref.multi_tensor_l2norm(65536, flag, [t], per_tensor=True),
                 "torch": lambda t: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(t)))}),
    ]  # fmt: skip


def dropout_cases(m: int = 8192, h: int = 4096, p: float = 0.1) -> List[Case]:
    """Dropout fwd / bwd and the fused bias-dropout-add at the Transformer layer's [8192, 4096] bf16.

    Ideal bytes count the keep mask at one bit per element (our ops' packed mask); PyTorch's bool
    mask moves eight times that.
    """
    from transformer_engine.plugin.backends._dropout_mask import pack_keep, unpack_keep

    fm, ref = _backends("misc")
    scale = 1.0 / (1.0 - p)
    randn = lambda *shape: torch.randn(*shape, device="cuda", dtype=BF16)  # noqa: E731
    make_x = lambda: (randn(m, h),)  # noqa: E731

    def make_bwd():
        keep = torch.rand(m, h, device="cuda") >= p
        return randn(m, h), keep, pack_keep(keep)

    make_bda = lambda: (randn(m, h), randn(h), randn(m, h))  # noqa: E731

    def keep_of(args, result):  # the provider's own mask, as bools
        return result[1] if result[1].dtype == torch.bool else unpack_keep(result[1], args[0].shape)

    def dropout_formula(args, result):  # y = x * m * scale with the provider's m
        return (args[0].float() * keep_of(args, result) * scale).to(BF16)

    def bda_formula(args, result):  # out = r + (x + b) * m * scale with the provider's m
        x, bias, residual = (a.float() for a in args)
        return (residual + (x + bias) * keep_of(args, result) * scale).to(BF16)

    mh, shape = m * h, f"[{m}, {h}] bf16, p={p}"
    mask_bytes = (mh // 8, torch.uint8)
    return [
        Case("dropout_fwd", shape, _nbytes((2 * mh, BF16), mask_bytes), make_x, {
            "flagos": lambda x: fm.dropout_fwd(x, p), "reference": lambda x: ref.dropout_fwd(x, p),
            "torch": lambda x: torch.ops.aten.native_dropout(x, p, train=True)}, expected=dropout_formula),
        Case("dropout_bwd", shape, _nbytes((2 * mh, BF16), mask_bytes), make_bwd, {
            "flagos": lambda dy, keep, packed: fm.dropout_bwd(dy, packed, p),
            "reference": lambda dy, keep, packed: ref.dropout_bwd(dy, packed, p),
            "torch": lambda dy, keep, packed: torch.ops.aten.native_dropout_backward(dy, keep, scale)}),
        Case("bias_dropout_add_fwd", shape, _nbytes((3 * mh, BF16), mask_bytes, (h, BF16)), make_bda, {
            "flagos": lambda x, b, r: fm.bias_dropout_add_fwd(x, b, r, p),
            "reference": lambda x, b, r: ref.bias_dropout_add_fwd(x, b, r, p),
            "torch": lambda x, b, r: r + F.dropout(x + b, p)}, expected=bda_formula),
    ]  # fmt: skip


_FAMILIES = (norm_cases, activation_cases, quantization_cases, softmax_cases, misc_cases, dropout_cases, optimizer_cases)


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s: 2 x nbytes / median time of dst.copy_(src)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / ms / 1e6


def _input_sets(case: Case) -> list:
    """Enough fresh input sets that cycling through them touches more than twice the L2 size."""
    first = case.make()
    per_set = max(1, _nbytes(*[a for a in _flatten(first) if isinstance(a, torch.Tensor)]))
    count = min(_MAX_SETS, max(1, math.ceil(2 * _L2_BYTES / per_set)))
    return [first] + [case.make() for _ in range(count - 1)]


def _flatten(args) -> list:
    out = []
    for a in args:
        out.extend(_flatten(a) if isinstance(a, (list, tuple)) else [a])
    return out


def _first_float(result) -> torch.Tensor:
    """The first tensor of a result as float32 (FP8 codes by their values, without the scale)."""
    return _flatten(result if isinstance(result, (tuple, list)) else (result,))[0].float()


def _formulation(case: Case, provider: str) -> Optional[Callable]:
    """The case's function that a provider calls (flag_gems: the torch one), or None when there is none."""
    return case.fns.get("torch" if provider == "flag_gems" else provider)


def _provider_fn(case: Case, provider: str) -> Callable:
    """The function a provider runs: flag_gems runs the torch formulation under ``flag_gems.use_gems()``."""
    fn = _formulation(case, provider)

    def run(*args):
        with _gems_context(provider):
            return fn(*args)

    return run


def check_error(case: Case, provider: str = "flagos") -> float:
    """Relative L2 error of a provider's first output against the reference's (or ``case.expected``'s,
    for flagos), on one fresh input set; NaN when there is no comparable result."""
    if provider != "flagos" and case.expected is not None:
        return math.nan  # a random op: its expected value needs the provider's own draw in flagos' layout
    args = case.make()
    cloned = tuple([t.clone() for t in a] if isinstance(a, list) else a for a in args)
    actual = _provider_fn(case, provider)(*args)
    expected = case.fns["reference"](*cloned) if case.expected is None else case.expected(args, actual)
    if actual is None:  # in-place ops: compare the updated second list (params) / outputs
        actual, expected = args[1], cloned[1]
    a, e = _first_float(actual).double(), _first_float(expected).double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def time_case(case: Case, provider: str) -> float:
    """Median milliseconds of one call, rotating over the input sets."""
    sets = itertools.cycle(_input_sets(case))
    fn = _formulation(case, provider)
    with _gems_context(provider):  # entered once: its cost stays out of the timing
        return triton.testing.do_bench(lambda: fn(*next(sets)), warmup=10, rep=100, return_mode="median")


def _gems_context(provider: str):
    import contextlib

    if provider != "flag_gems":
        return contextlib.nullcontext()
    import flag_gems

    return flag_gems.use_gems()


def _available(providers: Sequence[str]) -> List[str]:
    """The providers that can run here (flag_gems only when the package imports), saying why one is dropped."""
    kept = list(providers)
    if "flag_gems" in kept:
        try:
            import flag_gems  # noqa: F401
        except Exception as exc:  # an optional package: missing or broken, it is reported, not fatal
            print(f"provider flag_gems skipped: {type(exc).__name__}: {exc}")
            kept.remove("flag_gems")
    return kept


def run(only: Sequence[str], providers: Sequence[str]) -> List[dict]:
    """Time every selected case for every selected provider that has it."""
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    rows = []
    for family in _FAMILIES:
        for case in family():
            if only and not any(word in case.name for word in only):
                continue
            flagos_err = check_error(case)
            for provider in providers:
                if _formulation(case, provider) is None:
                    continue
                err = check_error(case, provider) if provider == "flag_gems" else flagos_err
                ms = time_case(case, provider)
                gbs = case.nbytes / ms / 1e6
                rows.append(dict(op=case.name, shape=case.shape, provider=provider, ms=ms, gb_s=gbs,
                                 of_copy=gbs / copy_gbs, rel_err_vs_reference=err, copy_gb_s=copy_gbs))  # fmt: skip
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--only", default="", help="comma-separated substrings of op names to run")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {PROVIDERS}")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py measures GPU kernels: it needs a CUDA device")
    providers = _available([p for p in args.providers.split(",") if p])
    rows = run([w for w in args.only.split(",") if w], providers)
    print_table(
        "memory-bound kernels (GB/s from the bytes model; of copy = fraction of the measured copy bandwidth)",
        ["op", "shape", "provider", "ms", "GB/s", "of copy", "rel err (flagos; flag_gems its own)"],
        [[r["op"], r["shape"], r["provider"], f"{r['ms']:.3f}", f"{r['gb_s']:.0f}", f"{r['of_copy']:.2f}",
          f"{r['rel_err_vs_reference']:.1e}"] for r in rows],
    )  # fmt: skip
    write_json(args.json, {"benchmark": "kernels", "rows": rows})


if __name__ == "__main__":
    main()
