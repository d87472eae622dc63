"""Context parallelism: te.DotProductAttention and te.TransformerLayer with the sequence split over P GPUs vs one GPU.

    python benchmarks/bench_cp.py --json cp2.json                                    # CP=2 on 2 GPUs, NCCL
    python benchmarks/bench_cp.py --cp 4 --seq 32768,65536 --module attention,layer --json cp4.json
    python benchmarks/bench_cp.py --cp 4 --seq 32768 --module layer --recipe delayed                # FP8 GEMMs
    python benchmarks/bench_cp.py --small --dist-backend gloo --cp 2 --module attention,layer   # CPU smoke run (numbers mean nothing)

Modules: ``attention`` is ``te.DotProductAttention`` (bshd, batch 1, 32 heads of 128, ``--gqa-groups`` 8 KV heads,
causal, no dropout); ``layer`` is ``te.TransformerLayer`` (hidden 4096, FFN 16384, the same heads, causal
self-attention, no dropout, sbhd input [S, 1, 4096]; ``--recipe delayed`` / ``current`` runs its GEMMs in FP8 with
the amaxes MAX-reduced over the CP ranks); bf16 on GPUs, float32 on CPU. For each sequence length S,
the whole sequence runs first on GPU 0 alone (the other ranks wait; if it fails, out of memory for instance, its
time is None and the rows have no efficiency), then, for each ``cp_comm_type``, every rank runs the module after
``set_context_parallel_group(WORLD, ranks, None, comm_type)`` on its part of the sequence: chunks r and 2P-1-r of 2P
(``shard_sequence``, which balances the causal work). A step is forward + backward with a random dY; times are
medians over ``--iters`` steps after ``--warmup``, and a CP step lasts as long as its slowest rank. Peak memory is
``torch.cuda.max_memory_allocated`` of each rank over the timed steps (module, inputs, steps; reset per case); the
table shows the largest rank's.

    scaling efficiency = t_1 / (P * t_P)        (100%: P GPUs are P times as fast as one)

What one rank sends per attention call (forward + backward; S tokens, h_kv KV heads of d):

    p2p         2 (P - 1) hops of its K/V block (2 S h_kv d / P elements), P hops of the float32 dK/dV block
    all_gather  K/V all-gathered forward, dK/dV reduce-scattered backward: (P - 1)/P of 2 S h_kv d each way
    a2a         8 all-to-alls (Q, K, V and O, forward and backward), each (P - 1)/P of its local tensor

"p2p" runs each ring block through the catalog's block ops (cuDNN or FlashAttention-2 on the GPU, see
``transformer_engine.pytorch.attention.context_parallel_ring``). A comm type that raises (out of memory; "a2a" with
head counts not divisible by P) is reported in its row.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from _harness import backend_policy, base_parser, init_rank, print_table, spawn_ranks, time_fn, write_json

MODULES = {"attention": "DotProductAttention", "layer": "TransformerLayer"}
COMM_TYPES = ("p2p", "a2a", "all_gather")


@dataclasses.dataclass(frozen=True)
class CPShape:
    heads: int = 32
    head_dim: int = 128
    gqa_groups: int = 8
    ffn: int = 16384

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


SMALL = CPShape(heads=4, head_dim=16, gqa_groups=2, ffn=256)


def _build(module: str, s: CPShape, seq: int, cp: int, comm_type: Optional[str], device: torch.device,
           dtype: torch.dtype) -> Tuple[torch.nn.Module, List[torch.Tensor], torch.Tensor]:
    """The module, its inputs and dY: the whole sequence for ``cp`` = 1, else this rank's part of it and the module
    split over the world with ``comm_type``."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.context_parallel import shard_sequence

    torch.manual_seed(0)  # every rank: the same weights and the same whole sequence
    if module == "attention":
        net = te.DotProductAttention(s.heads, s.head_dim, num_gqa_groups=s.gqa_groups, attention_dropout=0.0, qkv_format="bshd",
                                     attn_mask_type="causal")
        tensors = [torch.randn(1, seq, h, s.head_dim, device=device, dtype=dtype) for h in (s.heads, s.gqa_groups, s.gqa_groups)]
        tensors.append(torch.randn(1, seq, s.hidden, device=device, dtype=dtype))
        seq_dim = 1
    else:
        net = te.TransformerLayer(s.hidden, s.ffn, s.heads, num_gqa_groups=s.gqa_groups, hidden_dropout=0.0, attention_dropout=0.0,
                                  self_attn_mask_type="causal", params_dtype=dtype, device=device)
        tensors = [torch.randn(seq, 1, s.hidden, device=device, dtype=dtype) for _ in range(2)]
        seq_dim = 0
    if cp > 1:
        net.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, comm_type)
        tensors = [shard_sequence(t, seq_dim, cp, dist.get_rank()) for t in tensors]
    *inputs, dy = tensors
    return net, [x.requires_grad_() for x in inputs], dy


def _measure(module: str, s: CPShape, seq: int, cp: int, comm_type: Optional[str], device: torch.device, dtype: torch.dtype,
             args, amax_group) -> Dict:
    """Median fwd+bwd ms and peak bytes of one case on this rank, or its error: {"ms", "peak_bytes"} or {"error"}.
    ``amax_group``: where an FP8 recipe MAX-reduces its amaxes (the CP ranks, whose weights are replicated)."""
    import transformer_engine.pytorch as te

    gc.collect()  # the previous case's module and tensors (and those of a step that raised) go first
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        net, inputs, dy = _build(module, s, seq, cp, comm_type, device, dtype)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # after the build: the whole sequence made for sharding is gone

        recipe = _recipe(args.recipe) if module == "layer" else None

        def step():
            with te.autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=amax_group):
                out = net(*inputs)
            out.backward(dy)
            net.zero_grad(set_to_none=True)
            for x in inputs:
                x.grad = None

        ms = time_fn(step, warmup=args.warmup, iters=args.iters, device=device)
        if args.profile and cp > 1:
            _print_top_kernels(step, f"{module}, seq {seq}, CP={cp} {comm_type}", device)
    except Exception as exc:  # out of memory, or a comm type that refuses these shapes: reported in the row
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"}
    return {"ms": ms, "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def _recipe(name: str):
    """The FP8 recipe of ``--recipe`` for the layer's GEMMs (None: bf16)."""
    from transformer_engine.common import recipe

    factories = {"bf16": lambda: None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling}
    return factories[name]()


def _print_top_kernels(step, title: str, device: torch.device, steps: int = 2) -> None:
    """Two more steps on every rank (their collectives must pair up), rank 0's under torch.profiler: its top kernels
    by GPU time per step."""
    from torch.profiler import ProfilerActivity, profile

    if dist.get_rank() != 0:
        for _ in range(steps):
            step()
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0] if device.type == "cuda" else []
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    rows = [[e.key[:70], e.count // steps, f"{e.device_time_total / steps / 1e3:.2f}"] for e in events[:12]]
    print_table(f"rank 0 kernels per step: {title}", ["kernel", "calls", "GPU ms"], rows)


def _over_ranks(result: Dict, device: torch.device) -> Dict:
    """One CP case over all ranks: the slowest rank's ms and every rank's peak bytes, or an error if any rank failed."""
    size, rank = dist.get_world_size(), dist.get_rank()
    t = torch.zeros(2 + size, dtype=torch.float64, device=device)  # [ms, failed, peak of rank 0, ..., peak of rank P-1]
    t[0], t[1], t[2 + rank] = result.get("ms") or 0.0, float("error" in result), result.get("peak_bytes") or 0
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[1]:
        return {"error": result.get("error", "failed on another rank")}
    peaks = [int(p) for p in t[2:].tolist()] if device.type == "cuda" else None
    return {"ms": t[0].item(), "peak_bytes_per_rank": peaks}


def _rank_main(rank: int, cp: int, args, init_file: str) -> None:
    device = init_rank(rank, cp, args.dist_backend, init_file)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))  # the ranks share the cores
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s = _shape(args)
    alone, _ = dist.new_subgroups(group_size=1)  # the one-GPU run reduces its amaxes on this rank (collective call)
    rows = []
    with backend_policy(args.backend):
        for module in args.module:
            for seq in args.seq:
                single = _measure(module, s, seq, 1, None, device, dtype, args, alone) if rank == 0 else {}
                dist.barrier()
                for comm_type in args.comm_types:
                    result = _over_ranks(_measure(module, s, seq, cp, comm_type, device, dtype, args, dist.group.WORLD), device)
                    t1, tp = single.get("ms"), result.get("ms")
                    rows.append({"module": module, "seq": seq, "comm_type": comm_type, "single_ms": t1,
                                 "single_peak_bytes": single.get("peak_bytes"), "single_error": single.get("error"),
                                 "cp_ms": tp, "cp_peak_bytes_per_rank": result.get("peak_bytes_per_rank"),
                                 "cp_error": result.get("error"),
                                 "scaling_efficiency": t1 / (cp * tp) if t1 is not None and tp is not None else None})
    if rank == 0:
        _report(s, cp, rows, dtype, args)
    dist.destroy_process_group()


def _report(s: CPShape, cp: int, rows: List[Dict], dtype: torch.dtype, args) -> None:
    for module in args.module:
        table = []
        for r in (r for r in rows if r["module"] == module):
            single = f"{r['single_ms']:.2f}" if r["single_ms"] is not None else (
                "OOM" if r["single_error"].startswith("OutOfMemoryError") else "error")
            efficiency = "n/a (no 1-GPU time)" if r["single_ms"] is None else (
                "n/a" if r["cp_ms"] is None else f"{100 * r['scaling_efficiency']:.1f}%")
            peaks = r["cp_peak_bytes_per_rank"]
            note = r["cp_error"] or (f"1 GPU: {r['single_error']}" if r["single_error"] else "")
            table.append([r["seq"], r["comm_type"], single, "error" if r["cp_ms"] is None else f"{r['cp_ms']:.2f}", efficiency,
                          "n/a" if peaks is None else f"{max(peaks) / 2**30:.2f}", note[:120]])
        shape = (f"b=1, {s.heads} heads / {s.gqa_groups} KV, d={s.head_dim}" if module == "attention"
                 else f"hidden {s.hidden}, FFN {s.ffn}, {s.heads} heads / {s.gqa_groups} KV, GEMMs {args.recipe}")
        print_table(f"{MODULES[module]} fwd+bwd ({shape}, causal, {str(dtype).removeprefix('torch.')}): "
                    f"1 GPU vs CP={cp} ({args.dist_backend}, median of {args.iters})",
                    ["seq", "comm type", "1 GPU ms", f"CP={cp} ms", "efficiency", "peak GiB per rank (max)", "note"], table)
    write_json(args.json,
               {"shape": dataclasses.asdict(s), "cp": cp, "dist_backend": args.dist_backend, "dtype": str(dtype), "recipe": args.recipe,
                           "warmup": args.warmup, "iters": args.iters, "rows": rows})


def _shape(args) -> CPShape:
    s = SMALL if args.small else CPShape()
    return s if args.gqa_groups is None else dataclasses.replace(s, gqa_groups=args.gqa_groups)


def _names(known):
    def parse(value: str) -> List[str]:
        names = value.split(",")
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {list(known)}")
        return names

    return parse


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size (ranks, one GPU each)")
    parser.add_argument("--module", type=_names(MODULES), default=["attention", "layer"], help="attention, layer or both (comma-separated)")
    parser.add_argument("--seq", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="sequence lengths, comma-separated (default 32768,65536; 256 with --small)")
    parser.add_argument("--comm-types", type=_names(COMM_TYPES), default=list(COMM_TYPES), help="cp_comm_types, comma-separated")
    parser.add_argument("--gqa-groups", type=int, default=None, help="KV heads (default 8; 2 with --small)")
    parser.add_argument("--dist-backend", choices=["nccl", "gloo"], default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run): 4 heads of 16, FFN 256")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--recipe", choices=["bf16", "delayed", "current"], default="bf16",
                        help="the layer's GEMMs in FP8 under this recipe (amaxes reduced over the CP ranks); attention stays bf16")
    parser.add_argument("--profile", action="store_true", help="print rank 0's top kernels by GPU time of each CP case")
    args = parser.parse_args()
    args.seq = args.seq or ([256] if args.small else [32768, 65536])
    if args.cp < 2:
        raise SystemExit("--cp must be at least 2")
    if any(seq % (2 * args.cp) for seq in args.seq):
        raise SystemExit(f"every --seq must be a multiple of 2 * cp = {2 * args.cp} (each rank holds 2 of 2P chunks)")
    spawn_ranks(_rank_main, args.cp, args, "cp")


if __name__ == "__main__":
    main()
