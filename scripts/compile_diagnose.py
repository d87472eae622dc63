"""What torch.compile makes of the TE modules on this machine: graph breaks (with reasons), a fullgraph
compile of one training step, and the time of eager against compiled steps.

Usage: python scripts/compile_diagnose.py [--device cuda] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from _harness import under_autocast  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402

RECIPES = {"bf16": None, "delayed": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling()}


def _modules(hidden: int, device: str):
    from bench_transformer_layer import FusedModulesLayer, LayerShape

    s = LayerShape(hidden=hidden, ffn=4 * hidden, heads=max(1, hidden // 64), seq=512, batch=16)
    kw = dict(params_dtype=torch.bfloat16, device=device)
    return {
        "Linear": (lambda: te.Linear(hidden, hidden, **kw), (8192, hidden)),
        "LayerNormMLP": (lambda: te.LayerNormMLP(hidden, 4 * hidden, **kw), (8192, hidden)),
        "te-blocks": (lambda: FusedModulesLayer(s, te, device=device), (s.seq, s.batch, hidden)),
        "TransformerLayer": (lambda: te.TransformerLayer(hidden, 4 * hidden, max(1, hidden // 64), **kw), (s.seq, s.batch, hidden)),
    }


def _ms(step, device: str, iters: int = 20) -> float:
    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--modules", default="Linear,LayerNormMLP,te-blocks,TransformerLayer")
    parser.add_argument("--recipes", default="bf16,delayed,current")
    args = parser.parse_args()
    table = _modules(args.hidden, args.device)
    for name in args.modules.split(","):
        build, shape = table[name]
        for recipe_name in args.recipes.split(","):
            torch._dynamo.reset()
            module, recipe = build(), RECIPES[recipe_name]
            x = torch.randn(*shape, device=args.device, dtype=torch.bfloat16, requires_grad=True)
            forward = under_autocast(module, recipe)
            forward(x).float().sum().backward()
            explained = torch._dynamo.explain(forward)(x)
            reasons = collections.Counter(
                (b.reason.split("Developer debug context:")[-1].strip().split("\n")[0][:120] or b.reason.split("\n")[0][:120],
                 f"{b.user_stack[-1].filename.split('transformer_engine')[-1]}:{b.user_stack[-1].lineno}" if b.user_stack else "")
                for b in explained.break_reasons)
            line = f"{name} {recipe_name}: graphs {explained.graph_count}, breaks {explained.graph_break_count}"
            try:
                torch._dynamo.reset()
                compiled = torch.compile(forward, fullgraph=True)

                def step(f):
                    f(x).float().sum().backward()
                    module.zero_grad(set_to_none=True)
                    x.grad = None

                eager_ms, compiled_ms = _ms(lambda: step(forward), args.device), _ms(lambda: step(compiled), args.device)
                line += f"; fullgraph OK: eager {eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms ({compiled_ms / eager_ms:.2f}x)"
            except Exception as exc:  # noqa: BLE001 - a diagnosis reports every failure
                line += f"; fullgraph FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                traceback.print_exc(limit=-6, file=sys.stderr)
            print(line, flush=True)
            for (reason, where), count in reasons.most_common(6):
                print(f"    {count} x {where}: {reason}", flush=True)


if __name__ == "__main__":
    main()
