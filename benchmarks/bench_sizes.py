"""FP8 at the sizes people train: one layer at hidden 1024 / 2048 / 4096, eager against torch.compile.

The layer (ISSUE "Speed at the sizes people train"): sequence 512 x batch 16 (8192 tokens), FFN 4h,
heads h / 64, causal, dropout 0.1, bf16 parameters, fwd+bwd with a random dy. Variants, each a ratio
against the plain PyTorch layer (nn.LayerNorm, nn.Linear, SDPA) measured eager in the same process:

- ``plain``: the baseline, eager and ``torch.compile``-d;
- ``te-layer``: ``te.TransformerLayer``, bf16 / FP8 delayed / FP8 current, eager and compiled (the modes
  of :data:`COMPILE_MODES`); FP8 delayed also captured with ``te.make_graphed_callables``.

Columns: median ms of a step started from an idle GPU (CUDA events; a loop that waits for each step, e.g.
to log its loss), the ratio against plain eager; the steady state of steps enqueued back to back (a loop
that never waits: the host runs ahead and its lead-in before a step's first kernel is hidden) and its
ratio against plain eager timed alike; host ms (the CPU time to issue one step from an idle GPU), step
memory (the peak a step adds over what was allocated before it), and the graph count of the compiled
forward. Also the
small-layer case: ``te.Linear(256, 256)`` on 16 tokens against ``nn.Linear``, eager and compiled.
Writes JSON (``--json``) and a PNG of speed-up against hidden size (``--plot``).

Usage: python benchmarks/bench_sizes.py [--hidden 1024,2048,4096] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from _harness import base_parser, host_ms, peak_memory, print_table, time_back_to_back, time_fn, under_autocast, write_json
from bench_transformer_layer import LayerShape, PlainLayer


@dataclass(frozen=True)
class Variant:
    name: str
    build: Callable[[LayerShape], nn.Module]
    recipe: Optional[Callable[[], object]] = None  # recipe factory, None: high precision
    mode: str = "eager"  # eager | graphs (te.make_graphed_callables) | one of COMPILE_MODES
    compile_ops: str = "traced"  # TE_FL_COMPILE_OPS while a compiled variant runs (traced: Inductor sees the tensor ops)

    @property
    def label(self) -> str:
        """The mode, with the compile-ops setting when it is not the default."""
        return self.mode if self.compile_ops == "traced" else f"{self.mode} ({self.compile_ops})"


#: The compiled modes: name -> (torch.compile's keywords, Inductor settings held while the variant compiles and
#: runs). ``compile``: Inductor's defaults (its Python wrapper launches every kernel); ``compile-cpp``: Inductor's
#: C++ wrapper (the same kernels launched from generated C++, no CUDA graphs, so any shape runs; a user sets
#: ``TORCHINDUCTOR_CPP_WRAPPER=1``: in torch 2.11 ``options={"cpp_wrapper": True}`` does not reach the backward
#: graph, compiled at the first backward, which then fails with "CudaKernelParamCache not populated");
#: ``compile-graphs``: ``mode="reduce-overhead"`` (Inductor's CUDA graphs: one replay per shape).
COMPILE_MODES = {
    "compile": ({}, {}),
    "compile-cpp": ({}, {"cpp_wrapper": True}),
    "compile-graphs": ({"mode": "reduce-overhead"}, {}),
}


#: Every mode a variant can run in.
MODES = ("eager", *COMPILE_MODES, "graphs")


def _recipes():
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    return {
        "delayed": lambda: DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16),
        "current": lambda: Float8CurrentScaling(),
    }


def _variants(device: str, compile_ops: List[str], modes: List[str]) -> List[Variant]:
    """Every variant of the ``modes`` asked (plain eager always: the baseline); the TE layer's compiled ones once
    per ``compile_ops`` setting (see Variant)."""
    import transformer_engine.pytorch as te

    recipes = _recipes()
    plain = lambda s: PlainLayer(s, device=device)  # noqa: E731
    layer = lambda s: te.TransformerLayer(s.hidden, s.ffn, s.heads, params_dtype=torch.bfloat16, device=device,  # noqa: E731
                                          self_attn_mask_type="causal")
    out = [Variant("plain", plain, mode=mode) for mode in ("eager", *COMPILE_MODES)]
    for name, recipe in [("bf16", None), ("fp8 delayed", recipes["delayed"]), ("fp8 current", recipes["current"])]:
        out.append(Variant(f"te-layer {name}", layer, recipe))
        out += [Variant(f"te-layer {name}", layer, recipe, mode, ops) for ops in compile_ops for mode in COMPILE_MODES]
    out.append(Variant("te-layer fp8 delayed", layer, recipes["delayed"], "graphs"))
    return [v for v in out if v.mode in modes or (v.name, v.mode) == ("plain", "eager")]


def _step(variant: Variant, s: LayerShape, device: str) -> Dict[str, object]:
    """Build the variant, run one eager step (FP8 state, warm caches), then wrap it as the mode asks."""
    import transformer_engine.pytorch as te

    module = variant.build(s)
    recipe = variant.recipe() if variant.recipe else None
    x = torch.randn(s.seq, s.batch, s.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    forward = under_autocast(module, recipe)
    forward(x).backward(dy)
    graphs = None
    if variant.mode in COMPILE_MODES:
        torch._dynamo.reset()
        forward = torch.compile(forward, **COMPILE_MODES[variant.mode][0])
        graphs = torch._dynamo.explain(under_autocast(module, recipe))(x).graph_count
    elif variant.mode == "graphs":
        kwargs = {} if recipe is None else {"fp8_enabled": True, "fp8_recipe": recipe}
        forward = te.make_graphed_callables(module, (x,), **kwargs)

    def step():
        forward(x).backward(dy)
        module.zero_grad(set_to_none=True)
        x.grad = None

    return {"step": step, "graphs": graphs}


def step_memory(step: Callable[[], None]) -> Optional[int]:
    """Bytes a step adds at its peak over what is allocated before it (parameters, FP8 state, and the
    memory earlier variants of this process still hold, e.g. CUDA-graph pools, are not counted)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    return peak_memory(step) - before


def layer_sweep(hiddens: List[int], device: str, iters: int, compile_ops: List[str], modes: List[str]) -> List[Dict[str, object]]:
    rows = []
    for hidden in hiddens:
        s = LayerShape(hidden=hidden, ffn=4 * hidden, heads=max(1, hidden // 64), seq=512, batch=16)
        base_ms = base_steady_ms = None
        for variant in _variants(device, compile_ops, modes):
            row = {"hidden": hidden, "variant": variant.name, "mode": variant.label}
            try:
                os.environ["TE_FL_COMPILE_OPS"] = variant.compile_ops  # read when Dynamo traces (first call)
                with inductor_settings(variant.mode):
                    built = _step(variant, s, device)
                    row["ms"] = time_fn(built["step"], warmup=5, iters=iters, device=torch.device(device))
                    row["steady_ms"] = time_back_to_back(built["step"], warmup=2, iters=iters, device=torch.device(device))
                    row["host_ms"] = host_ms(built["step"], device)
                    row["peak_bytes"] = None if variant.mode == "graphs" else step_memory(built["step"])
                    row["graphs"] = built["graphs"]
            except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if variant.name == "plain" and variant.mode == "eager":
                base_ms, base_steady_ms = row.get("ms"), row.get("steady_ms")
            row["ratio"] = row["ms"] / base_ms if base_ms and "ms" in row else None
            row["steady_ratio"] = row["steady_ms"] / base_steady_ms if base_steady_ms and "steady_ms" in row else None
            rows.append(row)
            print(row, flush=True)
            torch._dynamo.reset()
    return rows


def inductor_settings(mode: str):
    """Context holding the Inductor settings of ``mode`` (see COMPILE_MODES; none for eager and graphs)."""
    from torch._inductor import config

    return config.patch(COMPILE_MODES[mode][1] if mode in COMPILE_MODES else {})


def small_linear(device: str, iters: int, modes: List[str]) -> List[Dict[str, object]]:
    """te.Linear(256, 256) on 16 tokens, fwd+bwd with a random dy, against nn.Linear, eager and in the compiled modes asked."""
    import transformer_engine.pytorch as te

    recipes = _recipes()
    rows, base = [], None
    cases = [("nn.Linear", lambda: nn.Linear(256, 256, device=device, dtype=torch.bfloat16), None),
             ("te.Linear bf16", lambda: te.Linear(256, 256, device=device, params_dtype=torch.bfloat16), None),
             ("te.Linear fp8 delayed", lambda: te.Linear(256, 256, device=device, params_dtype=torch.bfloat16), recipes["delayed"])]
    for name, build, recipe in cases:
        for mode in [m for m in ("eager", *COMPILE_MODES) if m in modes or m == "eager"]:
            module = build()
            x = torch.randn(16, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(16, 256, device=device, dtype=torch.bfloat16)
            forward = under_autocast(module, recipe() if recipe else None)
            forward(x).backward(dy)
            if mode in COMPILE_MODES:
                torch._dynamo.reset()
                forward = torch.compile(forward, **COMPILE_MODES[mode][0])

            def step(forward=forward, module=module, x=x, dy=dy):
                forward(x).backward(dy)
                module.zero_grad(set_to_none=True)
                x.grad = None

            row = {"case": name, "mode": mode}
            try:
                with inductor_settings(mode):
                    step()  # (compiles)
                    row["us"] = time_fn(step, warmup=10, iters=200, device=torch.device(device)) * 1e3
            except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"
            base = row.get("us") if (name, mode) == ("nn.Linear", "eager") else base
            row["ratio"] = row["us"] / base if base and "us" in row else None
            rows.append(row)
            print(rows[-1], flush=True)
    return rows


def plot(rows: List[Dict[str, object]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    keys = sorted({(r["variant"], r["mode"]) for r in rows if r.get("ratio")})
    variants = sorted({variant for variant, _ in keys})
    styles = {"eager": "-", "compile": "--", "compile-cpp": (0, (5, 1, 1, 1)), "compile-graphs": ":", "graphs": "-."}
    for variant, mode in keys:  # one colour per variant, one line style per mode
        points = [(r["hidden"], 1 / r["ratio"]) for r in rows if (r["variant"], r["mode"]) == (variant, mode) and r.get("ratio")]
        ax.plot(*zip(*points), marker="o", color=f"C{variants.index(variant)}", linestyle=styles.get(mode, "-"),
                label=f"{variant} ({mode})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hidden size (8192 tokens, FFN 4h)")
    ax.set_ylabel("speed-up over plain PyTorch bf16 eager")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="1024,2048,4096", help="comma-separated hidden sizes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--plot", default=None, help="write the speed-up plot (PNG) here")
    parser.add_argument("--compile-ops", default="traced",
                        help="comma list of TE_FL_COMPILE_OPS settings for the TE layer's compiled variants (traced, custom_op)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of the modes to time, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hiddens = [int(h) for h in args.hidden.split(",")]
    rows = layer_sweep(hiddens, device, args.iters, args.compile_ops.split(","), modes)
    print_table("one layer, 8192 tokens, fwd+bwd (ratio: against plain eager)",
                ["hidden", "variant", "mode", "ms", "ratio", "steady ms", "steady ratio", "host ms", "step GiB", "graphs"],
                [[r["hidden"], r["variant"], r["mode"], f"{r['ms']:.2f}" if "ms" in r else r.get("error", ""),
                  f"{r['ratio']:.2f}x" if r.get("ratio") else "", f"{r['steady_ms']:.2f}" if "steady_ms" in r else "",
                  f"{r['steady_ratio']:.2f}x" if r.get("steady_ratio") else "", f"{r['host_ms']:.2f}" if "host_ms" in r else "",
                  f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "", r.get("graphs") or ""] for r in rows])
    small = small_linear(device, args.iters, modes)
    print_table("te.Linear(256, 256), 16 tokens, fwd+bwd", ["case", "mode", "us", "ratio"],
                [[r["case"], r["mode"], f"{r['us']:.0f}" if "us" in r else r["error"], f"{r['ratio']:.2f}x" if r["ratio"] else ""]
                 for r in small])
    if args.plot:
        plot(rows, args.plot)
    write_json(args.json, {"layer": rows, "small_linear": small})


if __name__ == "__main__":
    main()
