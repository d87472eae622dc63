"""te.LayerNorm / te.RMSNorm modules, fwd+bwd, against PyTorch's modules: achieved bandwidth (PERF.md).

PERF.md's harness: the module's forward and backward on x [16384, 4096] bf16 with a random dy,
``triton.testing.do_bench`` median, bandwidth = ideal bytes / time. Ideal bytes: x read twice
(forward, backward), y written, dy read, dx written (5 M H elements), the parameters read twice and
their gradients written (negligible). PERF.md quotes NVIDIA TE 2.20.2 on this GPU at 1.54 TB/s
(LayerNorm) and 1.87 TB/s (RMSNorm); the target is 1.3x of that.

At this size the TE modules' GPU work (about 0.18 ms) is shorter than the host time of one step, so the
result follows the host's speed, which on the lent machines changes by 3x from one run to the next
(0.19 to 0.70 ms for one tree within a minute). Each module is therefore timed ``--repeats`` times,
the modules taking turns, and the table gives the median (the TB/s column) with the fastest and
slowest run.

    python benchmarks/bench_norm_modules.py --json norms.json
"""

from __future__ import annotations

import statistics

import torch
import triton.testing

from _harness import backend_policy, base_parser, print_table, write_json

#: NVIDIA TE 2.20.2 on the H200, same harness (PERF.md), TB/s.
TE_TBS = {"LayerNorm": 1.54, "RMSNorm": 1.87}
TARGET = 1.3


def ideal_bytes(m: int, h: int, params: int, dtype: torch.dtype) -> int:
    """5 M H activations (x twice, y, dy, dx) + each parameter read twice and its gradient written."""
    size = torch.empty((), dtype=dtype).element_size()
    return (5 * m * h + 3 * params * h) * size


def time_module(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> float:
    """Median ms of y = module(x); y.backward(dy), gradients set to None before each call."""

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).backward(dy)

    return triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5, help="timings per module, the modules taking turns")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm_modules.py measures GPU bandwidth: it needs a CUDA device")
    import transformer_engine.pytorch as te

    m, h, dtype = args.m, args.h, torch.bfloat16
    x = torch.randn(m, h, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(m, h, device="cuda", dtype=dtype)
    kw = dict(device="cuda", dtype=dtype)
    modules = {
        ("LayerNorm", "torch.nn.LayerNorm"): torch.nn.LayerNorm(h, **kw),
        ("LayerNorm", "te.LayerNorm"): te.LayerNorm(h, dtype=dtype, device="cuda"),
        ("RMSNorm", "torch.nn.RMSNorm"): torch.nn.RMSNorm(h, **kw),
        ("RMSNorm", "te.RMSNorm"): te.RMSNorm(h, dtype=dtype, device="cuda"),
    }
    times = {key: [] for key in modules}
    with backend_policy(args.backend):
        for _ in range(args.repeats):
            for key, module in modules.items():
                times[key].append(time_module(module, x, dy))
    rows = []
    for (kind, name), module in modules.items():
        runs = times[(kind, name)]
        ms = statistics.median(runs)
        tbs = ideal_bytes(m, h, sum(p.numel() // h for p in module.parameters()), dtype) / ms / 1e9
        rows.append(dict(norm=kind, module=name, ms=ms, ms_min=min(runs), ms_max=max(runs), runs_ms=runs, tb_s=tbs,
                         vs_te=tbs / TE_TBS[kind]))
    print_table(
        f"norm modules fwd+bwd [{m}, {h}] bf16 (ideal bytes / median of {args.repeats} timings; NVIDIA TE per PERF.md, "
        f"target {TARGET}x TE)",
        ["norm", "module", "ms (median)", "fastest - slowest", "TB/s", "vs NVIDIA TE"],
        [[r["norm"], r["module"], f"{r['ms']:.3f}", f"{r['ms_min']:.3f} - {r['ms_max']:.3f}", f"{r['tb_s']:.2f}", f"{r['vs_te']:.2f}x"]
         for r in rows],
    )
    write_json(args.json, {"benchmark": "norm_modules", "shape": {"m": m, "h": h}, "repeats": args.repeats, "te_tb_s": TE_TBS,
                           "rows": rows})


if __name__ == "__main__":
    main()
