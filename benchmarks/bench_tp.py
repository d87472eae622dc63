"""Tensor parallelism: te.TransformerLayer (PERF.md's layer) at TP=P with sequence parallelism vs one GPU, same global batch.

    python benchmarks/bench_tp.py --json tp.json                      # 2 ranks on 2 GPUs, NCCL
    python benchmarks/bench_tp.py --tp 4 --json tp4.json
    python benchmarks/bench_tp.py --small --dist-backend gloo         # CPU smoke run (numbers mean nothing)
    python benchmarks/bench_tp.py --variants "bf16, CUDA graph;FP8 delayed, CUDA graph" --profile-comm

Each variant (bf16, FP8 delayed, current and block scaling; on GPUs also each of them captured by
``te.make_graphed_callables``) runs forward + backward with a random dy, first on GPU 0 alone with the
whole batch [s, b, h], then on P GPUs, each holding [s/P, b, h] and 1/P of the weights
(``set_parallel_mode=True, sequence_parallel=True``). Times are medians over iterations; a TP step
counts as long as its slowest rank. The "comm overlap" variants build the TP layer with
``ub_tp_comm_overlap=True``: the GEMMs next to a sequence-parallel all-gather / reduce-scatter, forward
and backward, pipelined with it (``transformer_engine.pytorch.parallel.overlap``). ``--profile-comm`` adds the NCCL kernel time per step
on rank 0 and the part of it no other kernel overlaps (copy-engine transfers are not kernels: not counted).

    scaling efficiency = t_1 / (P * t_P)        (100%: P GPUs are P times as fast as one)

Communication model, per layer and step: 4 all-gathers (QKV and FC1 inputs forward; proj and FC2
grad outputs backward; FP8 payload under FP8) and 4 reduce-scatters (proj and FC2 outputs forward; QKV
and FC1 input gradients backward; bf16) of an [s, b, h] tensor, each moving (P - 1) / P of it per GPU.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from _harness import backend_policy, base_parser, fwd_bwd_step, init_rank, peak_memory, print_table, spawn_ranks, time_fn, write_json
from bench_transformer_layer import SMALL, LayerShape


def _variants():
    from transformer_engine.common import recipe

    delayed = lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    variants = {  # name: (recipe factory, captured by te.make_graphed_callables, pipelined collectives)
        "bf16": (None, False, False),
        "FP8 delayed": (delayed, False, False),
        "FP8 current": (recipe.Float8CurrentScaling, False, False),
        "FP8 block": (recipe.Float8BlockScaling, False, False),  # its SP all-gathers move bf16 (gathered, then cast)
        "bf16, CUDA graph": (None, True, False),
        "FP8 delayed, CUDA graph": (delayed, True, False),
        "FP8 current, CUDA graph": (recipe.Float8CurrentScaling, True, False),
        "FP8 block, CUDA graph": (recipe.Float8BlockScaling, True, False),
    }
    for name in ("FP8 delayed", "bf16, CUDA graph", "FP8 delayed, CUDA graph", "FP8 current, CUDA graph", "FP8 block, CUDA graph"):
        factory, graphed, _ = variants[name]
        variants[f"{name}, comm overlap"] = (factory, graphed, True)  # ub_tp_comm_overlap=True
    return variants


def _merged(intervals: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The union of [start, end) intervals as sorted disjoint intervals."""
    out: List[Tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a: List[Tuple[int, int]], b: List[Tuple[int, int]]) -> int:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_time(step: Callable[[], None], device: torch.device, steps: int = 3) -> Dict:
    """GPU time per step of the communication kernels (NCCL), and the part no other kernel overlaps (exposed), in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    spans = {True: [], False: []}
    for e in kernels:
        spans["nccl" in e.name().lower()].append((e.start_ns(), e.start_ns() + e.duration_ns()))
    comm, compute = _merged(spans[True]), _merged(spans[False])
    comm_ns = sum(end - start for start, end in comm)
    return {"comm_ms": comm_ns / steps / 1e6, "exposed_comm_ms": (comm_ns - _overlap(comm, compute)) / steps / 1e6}


def comm_bytes_per_gpu(s: LayerShape, tp: int, fp8: bool) -> float:
    """Bytes one GPU sends per step under the model of the module docstring."""
    elements = s.seq * s.batch * s.hidden * (tp - 1) / tp
    return 4 * elements * (1 if fp8 else 2) + 4 * elements * 2


def _layer(s: LayerShape, device: torch.device, tp: int, overlap: bool = False) -> torch.nn.Module:
    import transformer_engine.pytorch as te

    parallel = dict(set_parallel_mode=True, sequence_parallel=True, tp_group=dist.group.WORLD, tp_size=tp,
                    ub_tp_comm_overlap=overlap) if tp > 1 else {}
    return te.TransformerLayer(s.hidden, s.ffn, s.heads, params_dtype=torch.bfloat16, device=device,
                               self_attn_mask_type="causal", **parallel)


def _measure(layer: torch.nn.Module, rows: int, s: LayerShape, recipe_factory: Optional[Callable], iters: int,
             amax_group, graphed: bool, profile_comm: bool = False) -> Dict:
    """Median fwd+bwd ms and peak memory of ``layer`` on [rows, b, h]; FP8 amaxes reduced over ``amax_group``;
    ``graphed``: captured first by ``te.make_graphed_callables`` (collectives and updates inside the graphs);
    ``profile_comm``: also the communication time per step (:func:`comm_time`, GPUs only)."""
    import transformer_engine.pytorch as te

    device = next(layer.parameters()).device
    x = torch.randn(rows, s.batch, s.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    recipe = None if recipe_factory is None else recipe_factory()
    if graphed:
        layer = te.make_graphed_callables(layer, (x,), enabled=recipe is not None, recipe=recipe, amax_reduction_group=amax_group)

    def context():
        if recipe is None or graphed:
            return contextlib.nullcontext()
        return te.autocast(recipe=recipe, amax_reduction_group=amax_group)

    step = fwd_bwd_step(layer, x, dy, context)
    ms = time_fn(step, warmup=5, iters=iters, device=device)
    result = {"ms": ms, "peak_bytes": None if graphed else peak_memory(step, device)}  # a replay's pool is not counted
    if profile_comm and device.type == "cuda":
        result.update(comm_time(step, device))
    return result


def _slowest(ms: float, device: torch.device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _run_variant(s: LayerShape, tp: int, device: torch.device, variant, iters: int, alone, profile_comm: bool) -> Dict:
    """One variant: the single-GPU layer on rank 0 (the others wait), then the TP layer on every rank.

    ``alone`` is a group of this rank only: the single-GPU run reduces its amaxes over it, not over the
    world (which the waiting ranks would never join).
    """
    recipe_factory, graphed, overlap = variant
    result: Dict = {}
    if dist.get_rank() == 0:
        result["single"] = _measure(_layer(s, device, 1), s.seq, s, recipe_factory, iters, alone, graphed)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    measured = _measure(_layer(s, device, tp, overlap), s.seq // tp, s, recipe_factory, iters, dist.group.WORLD, graphed,
                        profile_comm)
    result["tp"] = dict(measured, ms=_slowest(measured["ms"], device))
    gc.collect()  # the layers (and their CUDA graphs, which hold NCCL work) go before the next variant
    return result


def _rank_main(rank: int, tp: int, args, init_file: str) -> None:
    device = init_rank(rank, tp, args.dist_backend, init_file)
    s = SMALL if args.small else LayerShape()
    alone, _ = dist.new_subgroups(group_size=1)
    results = {}
    with backend_policy(args.backend):
        for name, variant in _variants().items():
            if args.variants and name not in args.variants:
                continue
            if variant[1] and device.type != "cuda":
                continue  # CUDA graphs need GPUs
            try:
                results[name] = _run_variant(s, tp, device, variant, args.iters, alone, args.profile_comm)
            except Exception as exc:  # a recipe this machine cannot run is reported, not fatal
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    if rank == 0:
        _report(s, tp, results, args)
    dist.destroy_process_group()


def _report(s: LayerShape, tp: int, results: Dict, args) -> None:
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "n/a", "n/a", "", "", "", "", r["error"][:80]])
            continue
        t1, tp_ms = r["single"]["ms"], r["tp"]["ms"]
        r["scaling_efficiency"] = t1 / (tp * tp_ms)
        r["tflops_per_gpu"] = {"single": s.flops() / t1 / 1e9, "tp": s.flops() / tp / tp_ms / 1e9}
        r["comm_bytes_per_gpu"] = comm_bytes_per_gpu(s, tp, fp8=name.startswith(("FP8 delayed", "FP8 current")))
        mem, comm = r["tp"]["peak_bytes"], r["tp"].get("comm_ms")
        rows.append([name, f"{t1:.2f}", f"{tp_ms:.2f}", f"{100 * r['scaling_efficiency']:.1f}%",
                     f"{r['tflops_per_gpu']['tp']:.0f}", f"{r['comm_bytes_per_gpu'] / 2**20:.1f}",
                     "n/a" if comm is None else f"{comm:.2f} / {r['tp']['exposed_comm_ms']:.2f}",
                     "n/a" if mem is None else f"{mem / 2**30:.2f}"])
    print_table(f"TransformerLayer fwd+bwd {s}: 1 GPU vs TP={tp} + sequence parallelism ({args.dist_backend})",
                ["variant", "1 GPU ms", f"TP={tp} ms", "efficiency", "TFLOP/s per GPU", "comm MiB per GPU",
                 "comm / exposed ms (rank 0)", "peak GiB per GPU"], rows)
    write_json(args.json, {"shape": s.__dict__, "tp": tp, "dist_backend": args.dist_backend, "results": results})


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks)")
    parser.add_argument("--dist-backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--small", action="store_true", help="tiny shape (CPU smoke run)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile-comm", action="store_true",
                        help="also profile a few TP steps: NCCL kernel time per step and the part no compute overlaps")
    parser.add_argument("--variants", type=lambda v: v.split(";"), default=None,
                        help=f"only these variants, separated by ';' (of: {'; '.join(_variants())})")
    args = parser.parse_args()
    unknown = set(args.variants or ()) - set(_variants())
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; known: {list(_variants())}")
    spawn_ranks(_rank_main, args.tp, args, "tp")


if __name__ == "__main__":
    main()
