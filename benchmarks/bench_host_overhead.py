"""Host overhead of small layers (PERF.md): wall time per call when the GPU work is negligible.

One ``Linear(256, 256)`` on 16 tokens, fwd+bwd and forward under ``torch.no_grad()``: ``torch.nn.Linear``
against ``te.Linear`` in bf16 and under FP8 delayed scaling (the step includes the scale update at the
end of backward). Also one small ``te.TransformerLayer`` (hidden 256, 4 heads, s 128, b 2) against
the plain PyTorch block of ``bench_transformer_layer.py``: at that size a step costs what the host
needs to launch it. On a GPU, the TE modules also run captured by ``te.make_graphed_callables``.
Times are wall-clock medians with the GPU synchronized after every call.

A second table gives the host cost of one call of each building block of an FP8 module (tiny
tensors, no synchronization inside the timed loop): where the overhead of a step comes from.

    python benchmarks/bench_host_overhead.py --json host.json
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from _harness import backend_policy, base_parser, fwd_bwd_step, print_table, write_json
from bench_transformer_layer import SMALL, PlainLayer, _te_layer

TOKENS, FEATURES = 16, 256


def wall_us(fn: Callable[[], object], device: str, iters: int = 200, warmup: int = 20) -> float:
    """Median wall-clock microseconds of ``fn()`` followed by a device synchronization."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[len(times) // 2]


def fwd_only(module, x, ctx) -> Callable[[], None]:
    def step():
        with torch.no_grad(), ctx():
            module(x)

    return step


def host_us_per_call(fn: Callable[[], object], device: str, calls: int = 500) -> float:
    """Host microseconds per call of ``fn`` over ``calls`` back-to-back calls (median of 5 rounds)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) * 1e6 / calls)
        sync()
    return sorted(rounds)[2]


def building_blocks(device: str, fp8) -> dict:
    """{name: host us per call} of the pieces one FP8 linear calls per step."""
    from transformer_engine.plugin import ops
    from transformer_engine.pytorch.quantization.delayed_update import reduce_and_update
    from transformer_engine.pytorch.quantization.recipe_state import RecipeState
    import transformer_engine.pytorch as te

    e4m3 = torch.float8_e4m3fn
    x = torch.randn(TOKENS, FEATURES, device=device, dtype=torch.bfloat16)
    w = torch.randn(FEATURES, FEATURES, device=device, dtype=torch.bfloat16)
    scale = torch.ones(1, device=device)
    q = x.to(e4m3)
    wq = w.to(e4m3)
    state = RecipeState.create(fp8, mode="forward", num_gemms=1, device=device)
    quantizer = state.make_quantizers()[0]
    blocks = {
        "torch.relu (one aten kernel)": lambda: torch.relu(x),
        "ops.relu (dispatch + Triton launch)": lambda: ops.relu(x),
        "ops.quantize": lambda: ops.quantize(x, scale, e4m3),
        "ops.cast_transpose": lambda: ops.cast_transpose(x, scale, e4m3),
        "Float8Quantizer.quantize (+ amax record)": lambda: quantizer.quantize(x),
        "torch.mm bf16": lambda: torch.mm(x, w.t()),
        "ops.gemm bf16": lambda: ops.gemm(x, w, None, None, None, trans_a=False, trans_b=True, out_dtype=None, out=None,
                                          accumulate=False, use_split_accumulator=True),
        "ops.gemm FP8": lambda: ops.gemm(q, wq, None, scale, scale, trans_a=False, trans_b=True, out_dtype=torch.bfloat16, out=None,
                                         accumulate=False, use_split_accumulator=True),
        "delayed-scaling update of one module state": lambda: reduce_and_update([state], fp8),
        "te.autocast enter + exit": lambda: te.autocast(recipe=fp8).__enter__().__exit__(None, None, None),
    }
    if device == "cuda":
        blocks["torch._scaled_mm"] = lambda: torch._scaled_mm(q, wq.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    return {name: host_us_per_call(fn, device) for name, fn in blocks.items()}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    fp8 = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    none = contextlib.nullcontext
    kw = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(TOKENS, FEATURES, requires_grad=True, **kw)
    x_layer = torch.randn(SMALL.seq, SMALL.batch, SMALL.hidden, requires_grad=True, **kw)
    linears = {
        "torch.nn.Linear": (torch.nn.Linear(FEATURES, FEATURES, **kw), none),
        "te.Linear bf16": (te.Linear(FEATURES, FEATURES, params_dtype=torch.bfloat16, device=device), none),
        "te.Linear FP8 delayed": (te.Linear(FEATURES, FEATURES, params_dtype=torch.bfloat16, device=device),
                                  lambda: te.autocast(recipe=fp8)),
    }
    layers = {
        "plain PyTorch layer": (PlainLayer(SMALL, device=device), none),
        "te.TransformerLayer bf16": (_te_layer(te, SMALL, device), none),
        "te.TransformerLayer FP8 delayed": (_te_layer(te, SMALL, device), lambda: te.autocast(recipe=fp8)),
    }
    if device == "cuda":  # the same modules captured by te.make_graphed_callables: a replay per fwd and bwd
        for name, graph in {"bf16": {}, "FP8 delayed": dict(enabled=True, recipe=fp8)}.items():
            linear = te.Linear(FEATURES, FEATURES, params_dtype=torch.bfloat16, device=device)
            linears[f"te.Linear {name}, CUDA graph"] = (te.make_graphed_callables(linear, (x,), **graph), none)
            layers[f"te.TransformerLayer {name}, CUDA graph"] = (
                te.make_graphed_callables(_te_layer(te, SMALL, device), (x_layer,), **graph), none)
    results = {}
    with backend_policy(args.backend):
        for name, (module, ctx) in linears.items():
            results[name] = {"fwd_bwd_us": wall_us(fwd_bwd_step(module, x, None, ctx), device, args.iters),
                             "fwd_us": wall_us(fwd_only(module, x, ctx), device, args.iters)}
        for name, (module, ctx) in layers.items():
            results[name] = {"fwd_bwd_us": wall_us(fwd_bwd_step(module, x_layer, None, ctx), device, args.iters // 4)}
    rows = []
    for name, r in results.items():
        base = results["torch.nn.Linear" if "Linear" in name else "plain PyTorch layer"]
        fwd = r.get("fwd_us")
        rows.append([name, f"{r['fwd_bwd_us']:.0f}", f"{r['fwd_bwd_us'] / base['fwd_bwd_us']:.2f}x",
                     "" if fwd is None else f"{fwd:.0f}", "" if fwd is None else f"{fwd / base['fwd_us']:.2f}x"])
    print_table(f"host overhead on {device}: Linear({FEATURES}, {FEATURES}) on {TOKENS} tokens; layer {SMALL}",
                ["module", "fwd+bwd us", "vs torch", "fwd us (no grad)", "vs torch"], rows)
    with backend_policy(args.backend):
        blocks = building_blocks(device, fp8)
    print_table("host cost per call of the building blocks", ["call", "host us"], [[k, f"{v:.1f}"] for k, v in blocks.items()])
    write_json(args.json, {"device": device, "results": results, "building_blocks_us": blocks})


if __name__ == "__main__":
    main()
