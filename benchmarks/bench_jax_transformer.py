"""JAX/Flax TransformerLayer fwd+bwd: bf16 vs FP8 (delayed and current scaling), plus an HLO check.

Layer (PERF.md headline, in JAX's [b, s, h] layout): hidden 4096, FFN 16384, 32 heads, sequence 2048,
batch 4, causal self-attention, dropout as the module defaults (0.1; ``--attention-dropout 0`` for the dropout-free
attention of most LLM pre-training, which runs on cuDNN's fused attention on a GPU), bf16 parameters and inputs,
no relative position bias (a GPT-style layer). One jitted training step = forward, backward w.r.t.
every variable (for FP8 the "grads" of fp8_metas are the next scaling state) and the loss
sum(out * dy) with a fixed random dy.

FLOP model (model FLOPs, causal attention counted as half):
    fwd = 2 t (4 h^2 + 2 h f) + 2 b s^2 h   (t = b s tokens; QKV + out, MLP, then QK^T + PV halved)
    fwd+bwd = 3 fwd
TFLOP/s = fwd+bwd FLOPs / median step time (time.perf_counter around ``block_until_ready``).

HLO check: "f8 dots emitted" counts the dot_generals on f8 operands in the lowered StableHLO (12 per
step for the 4 GEMMs x fprop/dgrad/wgrad); the compiled module is searched for cuBLASLt FP8 GEMM calls
(``__cublas$lt$matmul$f8``), other GEMM custom calls, and ``dot`` ops that still take f8 operands
(FP8 dots XLA did not rewrite: those run emulated), and for cuDNN fused-attention calls (``__cudnn$fmha...``:
forward and backward). On CPU there are no custom calls at all.

    python benchmarks/bench_jax_transformer.py --json jax_transformer.json
    python benchmarks/bench_jax_transformer.py --small          # CPU smoke run, tiny layer
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Optional

import jax
import jax.numpy as jnp

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

RECIPES = {
    "bf16": None,
    "fp8_delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16),
    "fp8_current": Float8CurrentScaling(fp8_format=Format.HYBRID),
}


@dataclass(frozen=True)
class Problem:
    """One layer shape."""

    batch: int = 4
    seqlen: int = 2048
    hidden: int = 4096
    ffn: int = 16384
    heads: int = 32
    dropout: float = 0.1
    attention_dropout: float = 0.1

    def flops(self) -> float:
        """Model FLOPs of one fwd+bwd (causal attention counted as half)."""
        tokens = self.batch * self.seqlen
        gemms = 2.0 * tokens * (4 * self.hidden**2 + 2 * self.hidden * self.ffn)
        attention = 2.0 * self.batch * self.seqlen**2 * self.hidden
        return 3.0 * (gemms + attention)


SMALL = Problem(batch=2, seqlen=128, hidden=256, ffn=1024, heads=4)


def _layer(p: Problem) -> te_flax.TransformerLayer:
    return te_flax.TransformerLayer(
        hidden_size=p.hidden, mlp_hidden_size=p.ffn, num_attention_heads=p.heads, hidden_dropout=p.dropout,
        attention_dropout=p.attention_dropout, self_attn_mask_type="causal", enable_relative_embedding=False,
        dtype=jnp.bfloat16,
    )


def _build(p: Problem, recipe):
    """(compiled step, variables, inputs) of one variant; tracing happens inside its autocast."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (p.batch, p.seqlen, p.hidden), jnp.bfloat16)
    dy = jax.random.normal(keys[1], x.shape, jnp.bfloat16)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        layer = _layer(p)
        variables = jax.jit(lambda: layer.init({"params": keys[2], "dropout": keys[3]}, x))()

        def loss(variables, x, dy, rng):
            out = layer.apply(variables, x, rngs={"dropout": rng})
            return jnp.sum(out.astype(jnp.float32) * dy.astype(jnp.float32)), out

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        lowered = step.lower(variables, x, dy, keys[3])
    emitted = sum(1 for line in lowered.as_text().splitlines() if "dot_general" in line and re.search(r"f8E[45]M[23]", line))
    return lowered.compile(), variables, (x, dy, keys[3]), emitted


def _hlo_report(hlo: str) -> Dict[str, int]:
    """Counts of FP8 GEMM custom calls, other GEMM custom calls, dots still on f8 operands and cuDNN attention calls."""
    fp8_gemms = len(re.findall(r'custom_call_target="__cublas\$lt\$matmul\$f8"', hlo))
    all_gemms = len(re.findall(r'custom_call_target="__cublas\$(?:lt\$matmul[^"]*|gemm)"', hlo))
    f8_dots = sum(1 for line in hlo.splitlines() if re.search(r"\bdot\(", line) and re.search(r"f8e[45]m[23]", line))
    return {"fp8_gemm_custom_calls": fp8_gemms, "other_gemm_custom_calls": all_gemms - fp8_gemms,
            "unrewritten_f8_dots": f8_dots, "cudnn_attention_calls": len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo))}


def _time(compiled, variables, args, warmup: int, iters: int) -> float:
    """Median milliseconds of one step (the FP8 state is fed back between steps, as in training)."""
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        (_, out), grads = compiled(variables, *args)
        jax.block_until_ready(grads)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        if "fp8_metas" in grads:
            variables = {**variables, "fp8_metas": grads["fp8_metas"]}
    return statistics.median(times)


def _memory(compiled) -> Optional[float]:
    """Static device memory of the compiled step in GiB (arguments + outputs + temporaries)."""
    try:
        m = compiled.memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes) / 2**30
    except (AttributeError, NotImplementedError):
        return None


def run(p: Problem, names, warmup: int, iters: int) -> Dict[str, dict]:
    """Benchmark each variant; the first one (bf16) is the baseline of the ratios and the output error."""
    results, baseline_out = {}, None
    for name in names:
        compiled, variables, args, emitted = _build(p, RECIPES[name])
        (loss, out), _ = compiled(variables, *args)
        baseline_out = out if baseline_out is None else baseline_out
        err = float(jnp.linalg.norm((out - baseline_out).astype(jnp.float32))
                    / jnp.linalg.norm(baseline_out.astype(jnp.float32)))
        ms = _time(compiled, variables, args, warmup, iters)
        results[name] = {"ms": ms, "tflops": p.flops() / ms / 1e9, "gib": _memory(compiled),
                         "out_rel_err_vs_bf16": err, "f8_dots_emitted": emitted,
                         **_hlo_report(compiled.as_text())}
    base = results[names[0]]["ms"]
    for r in results.values():
        r["ratio"] = r["ms"] / base
    return results


def _print(p: Problem, results: Dict[str, dict]) -> None:
    headers = ("variant", "ms", "ratio", "TFLOP/s", "GiB", "out rel err", "f8 dots emitted", "FP8 GEMMs",
               "other GEMMs", "f8 dots left", "cuDNN attention")
    rows = [(n, f"{r['ms']:.2f}", f"{r['ratio']:.2f}x", f"{r['tflops']:.0f}",
             "-" if r["gib"] is None else f"{r['gib']:.1f}", f"{r['out_rel_err_vs_bf16']:.3g}",
             r["f8_dots_emitted"], r["fp8_gemm_custom_calls"], r["other_gemm_custom_calls"], r["unrewritten_f8_dots"],
             r["cudnn_attention_calls"])
            for n, r in results.items()]
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\nJAX TransformerLayer fwd+bwd {asdict(p)} on {jax.devices()[0].device_kind}")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for name, r in results.items():
        if name != "bf16":
            verdict = "yes" if r["fp8_gemm_custom_calls"] and not r["unrewritten_f8_dots"] else "NO"
            print(f"{name}: FP8 dots became cuBLASLt FP8 GEMMs: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--small", action="store_true", help="a tiny layer (CPU smoke run)")
    parser.add_argument("--variants", default=",".join(RECIPES), help=f"comma list from {list(RECIPES)}")
    parser.add_argument("--batch", type=int, default=None, help="override the batch size")
    parser.add_argument("--attention-dropout", type=float, default=None, help="override the attention dropout (0.1)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(RECIPES)}")
    p = SMALL if args.small else Problem()
    if args.batch:
        p = Problem(**{**asdict(p), "batch": args.batch})
    if args.attention_dropout is not None:
        p = Problem(**{**asdict(p), "attention_dropout": args.attention_dropout})
    results = run(p, names, args.warmup, args.iters)
    _print(p, results)
    if args.json:
        env = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "python": platform.python_version(),
               "jax": jax.__version__, "device": jax.devices()[0].device_kind}
        Path(args.json).write_text(json.dumps({"environment": env, "problem": asdict(p), "results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
