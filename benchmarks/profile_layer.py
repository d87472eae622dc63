"""Where the time and memory of one headline-layer step go: kernels by GPU time, and saved activations.

For each variant (plain PyTorch, ``te.TransformerLayer`` bf16 and FP8) this runs a few fwd+bwd steps
under ``torch.profiler`` and prints

- wall time per step (each step waited for, as the headline benchmark times it, and back to back:
  steps enqueued without a wait between them), the GPU busy time per step (sum of kernel durations)
  and the host time per step (enqueueing one step on an idle GPU): when the host time reaches the
  wall time and the GPU is busy far less, the step is bound by the host;
- the operations that synchronize the host with the GPU (``torch.cuda.set_sync_debug_mode``), by
  source line;
- the kernels with the largest total GPU time, with their call counts per step;
- the GPU's idle time between kernels per step and the largest gaps (the kernels on either side):
  where the GPU waited for the host;
- the tensors autograd saves for backward (by storage, so views are counted once; parameters
  left out), grouped by shape and dtype: what the activation memory consists of;
- on a GPU, what is allocated at the step's peak (``torch.cuda.memory`` history of one step): each
  live block by the line of our code (or the benchmark's) that allocated it, so the table names what
  the peak consists of and where in the step it happens.

    python benchmarks/profile_layer.py --variants plain,bf16,fp8_delayed --json profile.json
    python benchmarks/profile_layer.py --variants fp8_delayed,fp8_delayed_graph        # eager vs captured
    python benchmarks/profile_layer.py --variants plain,fp8_delayed --memory-only   # the peak alone
    python benchmarks/profile_layer.py --small                          # CPU smoke run
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter, defaultdict
from typing import Callable, Dict, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from _harness import backend_policy, base_parser, fwd_bwd_step, host_ms, print_table, time_back_to_back, time_fn, write_json
from bench_transformer_layer import SMALL, LayerShape, PlainLayer, _te_layer

STEPS = 3


def build(variant: str, s: LayerShape, device: str) -> Tuple[torch.nn.Module, Callable]:
    """(layer, context factory) of a variant name."""
    if variant == "plain":
        return PlainLayer(s, device=device), contextlib.nullcontext
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    recipes = {
        "bf16": None,
        "fp8_delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
        "fp8_current": recipe.Float8CurrentScaling(),
        "fp8_block": recipe.Float8BlockScaling(),
    }
    name, graphed = variant.removesuffix("_graph"), variant.endswith("_graph")
    if name not in recipes:
        raise SystemExit(f"unknown variant {variant!r}; choose from plain, {', '.join(recipes)} (each also with _graph)")
    rec = recipes[name]
    layer = _te_layer(te, s, device)
    if graphed:
        sample = torch.randn(s.seq, s.batch, s.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        return te.make_graphed_callables(layer, (sample,), enabled=rec is not None, recipe=rec), contextlib.nullcontext
    ctx = contextlib.nullcontext if rec is None else (lambda: te.autocast(recipe=rec))
    return layer, ctx


def saved_tensors(layer, x, ctx) -> Counter:
    """bytes saved for backward per (shape, dtype), each storage counted once, parameters left out."""
    seen, sizes = {p.untyped_storage().data_ptr() for p in layer.parameters()}, Counter()

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            sizes[(tuple(t.shape), str(t.dtype).replace("torch.", ""))] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        layer(x)
    return sizes


def kernel_table(step: Callable, device) -> Tuple[Dict[str, Tuple[float, int]], float, list]:
    """{kernel name: (GPU us per step, calls per step)}, the GPU busy us per step of ``step()`` and its
    GPU kernels as (start us, end us, name), in order."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    kernels: Dict[str, list] = defaultdict(lambda: [0.0, 0])
    busy, spans = 0.0, []
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if (device == "cuda") != on_gpu or (not on_gpu and event.cpu_parent is not None):
            continue
        duration = event.device_time if on_gpu else event.cpu_time_total
        kernels[event.name][0] += duration / STEPS
        kernels[event.name][1] += 1
        busy += duration / STEPS
        if on_gpu:
            spans.append((event.time_range.start, event.time_range.end, event.name))
    return {k: (v[0], v[1] // STEPS) for k, v in kernels.items()}, busy, sorted(spans)


def idle_gaps(spans: list, top: int) -> Tuple[float, list]:
    """GPU idle us per step between consecutive kernels of a profile of ``STEPS`` steps (the gap before
    each step's first kernel included), and the ``top`` largest gaps as (us, kernel before, kernel after).

    Idle time inside a step is where the GPU waited for the host (launch latency, Python between two
    kernels) or for a synchronization; on a GPU-bound step it is near zero.
    """
    gaps, last_end, last_name = [], None, ""
    for start, end, name in spans:
        if last_end is not None and start > last_end:
            gaps.append((start - last_end, last_name, name))
        if last_end is None or end > last_end:
            last_end, last_name = end, name
    return sum(g[0] for g in gaps) / STEPS, sorted(gaps, reverse=True)[:top]


def sync_points(step: Callable, device: str) -> Counter:
    """Source lines of the operations that synchronize the host with the GPU during one step."""
    if device != "cuda":
        return Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return Counter(f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message))


def host_profile(step: Callable, device: str, top: int) -> str:
    """cProfile of the host side of 5 steps: the ``top`` functions by own time and by cumulative time.

    Autograd runs the backward on the calling thread meanwhile (``set_multithreading_enabled(False)``),
    so cProfile sees it too (on a GPU it normally runs on a device thread).
    """
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        step()  # warm the calling thread's caches (cuDNN keeps its graphs per thread)
        profiler.enable()
        for _ in range(5):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def op_sources(step: Callable, op: str, device: str) -> Counter:
    """(input shapes, innermost frames of our code) of every call of the aten ``op`` during one step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step()
    found = Counter()
    for event in prof.events():
        if event.name == op:
            found[f"{event.input_shapes} <- {' <- '.join(_our_callers(event))}"] += 1
    return found


def peak_breakdown(step: Callable) -> Tuple[int, str, Counter]:
    """(peak bytes, the line whose allocation reached the peak, {allocating line: live bytes at the peak}) of one step.

    Blocks allocated before the step (parameters, inputs) count as "before the step". A line is the
    innermost frame of transformer_engine or of the benchmarks, else the innermost Python frame.
    """
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: Dict[int, Tuple[int, str]] = {}  # addr -> (bytes, allocating line)
    freed_before = 0  # blocks of before the step that the step frees
    now = peak = before
    peak_live: Dict[int, Tuple[int, str]] = {}
    peak_freed_before, peak_line = 0, "before the step"
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _allocating_line(event.get("frames", [])))
            now += event["size"]
            if now > peak:
                peak, peak_live, peak_freed_before, peak_line = now, dict(live), freed_before, live[event["addr"]][1]
        elif event["action"] == "free_requested":
            now -= event["size"]
            if live.pop(event["addr"], None) is None:
                freed_before += event["size"]
    by_line = Counter({"before the step": before - peak_freed_before})
    for size, line in peak_live.values():
        by_line[line] += size
    return peak, peak_line, by_line


def _allocating_line(frames) -> str:
    ours = [f for f in frames if "transformer_engine/" in f["filename"] or "benchmarks/" in f["filename"]]
    frame = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{frame['filename'].rsplit('/', 2)[-1] if 'benchmarks/' in frame['filename'] else frame['filename'].split('transformer_engine/')[-1]}:{frame['line']} {frame['name']}"  # noqa: E501


def _our_callers(event, depth: int = 3):
    """The innermost ``depth`` Python frames of transformer_engine that (indirectly) called a profiler event."""
    frames, parent = [], event.cpu_parent
    while parent is not None and len(frames) < depth:
        if "transformer_engine/" in parent.name:
            frames.append(parent.name.split("transformer_engine/", 1)[1])
        parent = parent.cpu_parent
    return frames


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape (CPU smoke test)")
    parser.add_argument("--variants", default="plain,bf16,fp8_delayed")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    parser.add_argument("--host-top", type=int, default=0, help="print the N functions with the most host time in a step (cProfile)")
    parser.add_argument("--memory-only", action="store_true", help="only the peak-memory breakdown (GPU)")
    parser.add_argument("--sources", default="", help="aten ops (comma separated) whose callers are listed, e.g. aten::copy_")
    args = parser.parse_args()
    s = SMALL if args.small else LayerShape()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {}
    with backend_policy(args.backend):
        for variant in args.variants.split(","):
            torch.manual_seed(0)
            layer, ctx = build(variant, s, device)
            x = torch.randn(s.seq, s.batch, s.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn_like(x)

            step = fwd_bwd_step(layer, x, dy, ctx)
            step()
            if device == "cuda":
                peak, peak_line, by_line = peak_breakdown(step)
                print_table(
                    f"{variant}: peak {peak / 2**20:.0f} MiB, reached by {peak_line}; live blocks at the peak by allocating line",
                    ["allocated at", "MiB"],
                    [[line[:100], f"{b / 2**20:.1f}"] for line, b in by_line.most_common(args.top) if b],
                )
                report[variant] = {"peak_bytes": peak, "peak_line": peak_line, "peak_by_line": dict(by_line)}
                if args.memory_only:
                    layer = None
                    continue
            ms = time_fn(step, warmup=3, iters=10, device=torch.device(device))
            chained = time_back_to_back(step, warmup=1, iters=20, device=torch.device(device))
            host = host_ms(step, device)
            syncs = sync_points(step, device)
            kernels, busy_us, spans = kernel_table(step, device)
            idle_us, largest_gaps = idle_gaps(spans, args.top // 2)
            saved = saved_tensors(layer, x, ctx)
            if args.host_top:
                print(host_profile(step, device, args.host_top))
            for op in filter(None, args.sources.split(",")):
                for where, count in op_sources(step, op, device).most_common():
                    print(f"{variant}: {op} x{count}: {where}")
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]
            print_table(
                f"{variant}: {ms:.2f} ms per step ({chained:.2f} back to back), GPU busy {busy_us / 1e3:.2f} ms, host {host:.2f} ms, "
                f"{sum(c for _, c in kernels.values())} kernels per step",
                ["kernel", "us/step", "calls/step", "share"],
                [[name[:90], f"{us:.0f}", calls, f"{us / busy_us:.1%}"] for name, (us, calls) in top],
            )
            print_table(
                f"{variant}: GPU idle between kernels {idle_us / 1e3:.2f} ms per step; the largest gaps",
                ["us", "after kernel", "before kernel"],
                [[f"{us:.0f}", before[:60], after[:60]] for us, before, after in largest_gaps],
            )
            print(f"{variant}: {sum(syncs.values())} host-GPU synchronizations per step", dict(syncs) or "")
            print_table(
                f"{variant}: saved for backward {sum(saved.values()) / 2**20:.0f} MiB",
                ["shape", "dtype", "MiB"],
                [[str(shape), dtype, f"{b / 2**20:.1f}"] for (shape, dtype), b in saved.most_common()],
            )
            report.setdefault(variant, {}).update({
                "ms": ms,
                "back_to_back_ms": chained,
                "gpu_busy_ms": busy_us / 1e3,
                "gpu_idle_ms": idle_us / 1e3,
                "host_ms": host,
                "sync_points": dict(syncs),
                "kernels": {k: {"us_per_step": us, "calls_per_step": c} for k, (us, c) in kernels.items()},
                "saved_bytes": {f"{shape} {dtype}": b for (shape, dtype), b in saved.items()},
            })
            layer = None
    write_json(args.json, {"shape": s.__dict__, "device": device, "variants": report})


if __name__ == "__main__":
    main()
