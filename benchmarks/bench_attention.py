"""Attention throughput, fwd / bwd / fwd+bwd: default dispatch, flagos (Triton), vendor, plain SDPA.

Shape (PERF.md kernel table): batch 4, sequence 2048, 32 heads, head dim 128, causal, bf16, bshd.
FLOP model: fwd = 4 b h s_q s_kv d (two GEMMs), halved when causal (only the lower triangle is
work); bwd = 2.5 fwd (five GEMMs, Q K^T recomputed); fwd+bwd = 3.5 fwd. TFLOP/s = FLOPs / median.

Providers: ``dispatch`` (``ops.fused_attn_fwd`` under the policy, ``--backend`` pins its preferred
kind; the backward runs on the backend that ran the forward), ``flagos`` and ``vendor`` (that backend
alone, through ``call_impl``), ``sdpa`` (``F.scaled_dot_product_attention`` with autograd, PyTorch's
default backend choice: the baseline, no TE-FL code); not in the default list: ``dpa`` (``te.DotProductAttention``,
the module's host time included) and ``fp8_dpa`` (the module under ``te.autocast(recipe=DelayedScaling(fp8_dpa=True))``:
q, k, v cast to FP8, the FP8 attention ops, dequantized gradients; on cuDNN's FP8 graphs with the optional
cudnn-frontend package, else the reference backend's emulation; compare it with ``dpa``). Every provider's output is first checked
against SDPA's (relative error in the table).

    python benchmarks/bench_attention.py --json attention.json
    python benchmarks/bench_attention.py --backend flagos --providers dispatch,sdpa
    python benchmarks/bench_attention.py --providers fp8_dpa,dpa --seqlen 8192 --batch 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from _harness import backend_policy, base_parser, peak_memory, print_table, time_fn, write_json

MODES = ("fwd", "bwd", "fwd+bwd")
_BWD_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
IMPL_IDS = {"flagos": "flagos.triton", "vendor": "vendor.cuda"}


@dataclass(frozen=True)
class Problem:
    """One attention shape; q [b, s, h, d], k / v [b, s, h_kv, d]."""

    batch: int = 4
    seqlen: int = 2048
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    causal: bool = True

    def flops(self, mode: str) -> float:
        fwd = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        return fwd * (0.5 if self.causal else 1.0) * _BWD_FACTOR[mode]

    def inputs(self) -> Tuple[torch.Tensor, ...]:
        """Fresh q, k, v, dO on the GPU (bshd)."""
        b, s, d = self.batch, self.seqlen, self.head_dim
        shapes = ((b, s, self.heads, d), (b, s, self.kv_heads, d), (b, s, self.kv_heads, d), (b, s, self.heads, d))
        return tuple(torch.randn(shape, device="cuda", dtype=self.dtype) for shape in shapes)

    def config(self):
        from transformer_engine.plugin.catalog.attention import AttentionConfig

        return AttentionConfig(softmax_scale=self.head_dim**-0.5, mask_type="causal" if self.causal else "no_mask")


@dataclass(frozen=True)
class Runner:
    """The three timed callables of one provider, its forward output and the impl that ran."""

    fwd: Callable[[], object]
    bwd: Callable[[], object]
    full: Callable[[], object]
    out: torch.Tensor
    impl: str


def _plugin_runner(problem: Problem, tensors, impl_id: Optional[str], backend: str) -> Runner:
    """fused_attn_fwd / fused_attn_bwd through the manager: by policy (impl_id None) or one backend."""
    from transformer_engine.plugin import ops
    from transformer_engine.plugin.core import get_default_manager

    manager, config = get_default_manager(), problem.config()
    q, k, v, dout = tensors

    def forward():
        with backend_policy(backend):
            if impl_id is None:
                return ops.fused_attn_fwd.traced(q, k, v, config)
            return manager.call_impl("fused_attn_fwd", impl_id, q, k, v, config), manager.registry.get_implementation("fused_attn_fwd",
                                                                                                                      impl_id)

    (out, ctx), impl = forward()

    def backward(out=out, ctx=ctx):
        return manager.call_impl("fused_attn_bwd", impl.impl_id, dout, q, k, v, out, ctx, config)

    def full():
        (o, c), _ = forward()
        return backward(o, c)

    return Runner(lambda: forward(), backward, full, out, impl.impl_id)


def _sdpa_runner(problem: Problem, tensors) -> Runner:
    """F.scaled_dot_product_attention on [b, h, s, d] copies, fwd and autograd bwd."""
    q, k, v, dout = (t.transpose(1, 2).contiguous().requires_grad_(i < 3) for i, t in enumerate(tensors))
    kwargs = dict(is_causal=problem.causal, enable_gqa=problem.kv_heads != problem.heads)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    out = forward()

    def backward():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    def full():
        return torch.autograd.grad(forward(), (q, k, v), dout)

    return Runner(lambda: forward(), backward, full, out.detach().transpose(1, 2), "torch.sdpa")


def _module_runner(problem: Problem, tensors, fp8: bool) -> Runner:
    """te.DotProductAttention, fwd and autograd bwd: in high precision, or under DelayedScaling(fp8_dpa=True) (``fp8``,
    one autocast per forward)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(tensors))
    dpa = te.DotProductAttention(problem.heads, problem.head_dim, num_gqa_groups=problem.kv_heads, qkv_format="bshd",
                                 attn_mask_type="causal" if problem.causal else "no_mask")
    recipe = DelayedScaling(fp8_dpa=True)

    def forward():
        with te.autocast(enabled=fp8, recipe=recipe):
            return dpa(q, k, v)

    for _ in range(2):  # scales from the amaxes of a first step, as in training
        torch.autograd.grad(forward(), (q, k, v), dout.flatten(-2))
    out = forward()

    def backward():
        return torch.autograd.grad(out, (q, k, v), dout.flatten(-2), retain_graph=True)

    def full():
        return torch.autograd.grad(forward(), (q, k, v), dout.flatten(-2))

    out_bshd = out.detach().unflatten(-1, (problem.heads, problem.head_dim))
    return Runner(lambda: forward(), backward, full, out_bshd, _fp8_impl(problem, q, k, v) if fp8 else "te.DotProductAttention")


def _fp8_impl(problem: Problem, q, k, v) -> str:
    """The implementation the dispatcher picks for this problem's FP8 attention forward (and why the others do not run)."""
    from transformer_engine.plugin.core import get_default_manager

    one = torch.ones((), device=q.device)
    decisions = get_default_manager().explain("fused_attn_fp8_fwd", *(t.detach().to(torch.float8_e4m3fn) for t in (q, k, v)), one, one,
                                              one, problem.config())
    chosen = next((d.impl_id for d in decisions if d.status == "selected"), "none")
    passed_over = [f"{d.impl_id}: {d.reason[:60]}" for d in decisions if d.status == "rejected"]
    return chosen + (f" ({'; '.join(passed_over)})" if passed_over else "")


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


def _measure(name: str, runner: Runner, problem: Problem, baseline: torch.Tensor, args) -> list:
    """Table rows of one provider: per mode, median ms, TFLOP/s, peak memory (fwd+bwd), error vs SDPA."""
    rows = []
    for mode, fn in zip(MODES, (runner.fwd, runner.bwd, runner.full)):
        ms = time_fn(fn, warmup=args.warmup, iters=args.iters)
        peak = peak_memory(fn) if mode == "fwd+bwd" else None
        rows.append({
            "provider": name, "impl": runner.impl, "mode": mode, "ms": ms,
            "tflops": problem.flops(mode) / ms / 1e9, "peak_gib": None if peak is None else peak / 2**30,
            "rel_err_vs_sdpa": _rel_err(runner.out, baseline),
        })
    return rows


def _providers(names, problem: Problem, tensors, backend: str) -> Dict[str, Callable[[], Runner]]:
    factories = {
        "dispatch": lambda: _plugin_runner(problem, tensors, None, backend),
        "flagos": lambda: _plugin_runner(problem, tensors, IMPL_IDS["flagos"], backend),
        "vendor": lambda: _plugin_runner(problem, tensors, IMPL_IDS["vendor"], backend),
        "sdpa": lambda: _sdpa_runner(problem, tensors),
        "dpa": lambda: _module_runner(problem, tensors, fp8=False),
        "fp8_dpa": lambda: _module_runner(problem, tensors, fp8=True),
    }
    unknown = set(names) - set(factories)
    if unknown:
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(factories)}")
    return {name: factories[name] for name in names}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--providers", default="dispatch,flagos,vendor,sdpa", help="comma-separated subset")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: kv heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    problem = Problem(args.batch, args.seqlen, args.heads, args.kv_heads or args.heads, args.head_dim,
                      getattr(torch, args.dtype), not args.no_causal)
    tensors = problem.inputs()
    providers = _providers(args.providers.split(","), problem, tensors, args.backend)
    baseline = _sdpa_runner(problem, tensors).out
    rows = []
    for name, make in providers.items():
        try:
            rows += _measure(name, make(), problem, baseline, args)
        except Exception as exc:  # noqa: BLE001 - one failing provider must not hide the others
            rows.append({"provider": name, "impl": f"failed: {type(exc).__name__}: {exc}"[:120], "mode": "-"})
    print_table(
        f"attention {problem} (backend pin: {args.backend})",
        ["provider", "impl", "mode", "ms", "TFLOP/s", "peak GiB", "rel err vs SDPA"],
        [[r["provider"], r["impl"], r["mode"], _fmt(r.get("ms")), _fmt(r.get("tflops"), 1), _fmt(r.get("peak_gib")),
          _fmt(r.get("rel_err_vs_sdpa"), 6)] for r in rows],
    )
    write_json(args.json, {"benchmark": "attention", "problem": {**problem.__dict__, "dtype": args.dtype}, "results": rows})


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}e}" if digits > 4 else f"{value:.{digits}f}"


if __name__ == "__main__":
    main()
