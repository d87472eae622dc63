"""Paired A/B of two library trees on one machine: a base tree against the working tree, timed in turns.

On the lent GPU hosts the host's speed drifts by up to 3x within minutes, so two benchmark runs a
minute apart cannot resolve a 10% change of a host-bound step. This script starts one worker process
per tree (``PYTHONPATH`` selects the tree; each worker reports the ``transformer_engine`` it imported),
builds the same cases in both, then times each case in short chunks, the trees taking turns (base,
new, new, base, ...), and reports per case each tree's median time per step and the median of the
paired ratios new / base with their quartiles: a drift of the host moves both sides of a pair alike.
Both workers are pinned to one and the same CPU core (they never run at once: the idle one waits on
its pipe), since two processes placed on different cores of these VMs ran the same plain PyTorch
step 30% apart. ``nn.Linear(256)`` is the control: the same code on both sides, its ratio shows what
bias is left.

Cases (a step is fwd+bwd, gradients cleared; FP8 = DelayedScaling HYBRID, history 16):

- ``small``: ``nn.Linear`` / ``te.Linear(256, 256)`` bf16 and FP8 on 16 tokens (``bench_host_overhead.py``'s), and
  ``nn.LayerNorm`` + ``nn.Linear`` / ``te.LayerNormLinear`` bf16, chunks of steps enqueued back to back (host time per step);
- ``norms`` (GPU): ``te.LayerNorm`` / ``te.RMSNorm`` / ``nn.LayerNorm`` on [16384, 4096] bf16;
- ``large`` (GPU): ``te.Linear`` 8192^3 FP8 and the headline ``te.TransformerLayer`` FP8, each step
  waited for (as ``bench_linear.py`` and ``bench_transformer_layer.py`` time them);
- ``block`` / ``current`` / ``mxfp8`` (GPU): the same two under ``Float8BlockScaling`` / ``Float8CurrentScaling`` /
  ``MXFP8BlockScaling`` (emulated on Hopper), ``mxfp8`` with the headline layer in bf16 too (its target is a ratio to it);
- ``layer1024`` (GPU): ``te.TransformerLayer`` at hidden 1024 (``bench_sizes.py``'s layer: 8192 tokens,
  host-bound) eager in bf16, FP8 delayed and FP8 current, and ``torch.compile`` of its FP8 delayed step
  (Inductor, no CUDA graphs), chunks enqueued back to back.

    git archive <rev> transformer_engine | tar -x -C /tmp/base     # the base tree
    python benchmarks/bench_ab.py --base-tree /tmp/base --json ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

from _harness import backend_policy, base_parser, fwd_bwd_step, print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("small", "norms", "large", "block", "current", "mxfp8", "layer1024")


def build_cases(groups, device: str) -> Dict[str, Tuple[Callable[[], None], int, bool]]:
    """{name: (step, steps per chunk, wait for each step)} of the chosen groups that run on ``device``."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

    from bench_host_overhead import FEATURES, TOKENS
    from bench_transformer_layer import LayerShape, _te_layer

    bf16, none = torch.bfloat16, contextlib.nullcontext
    fp8 = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")

    def under_fp8():
        return te.autocast(recipe=fp8)

    cases = {}
    if "small" in groups:
        x = torch.randn(TOKENS, FEATURES, device=device, dtype=bf16, requires_grad=True)
        plain = torch.nn.Linear(FEATURES, FEATURES, device=device, dtype=bf16)
        cases[f"nn.Linear({FEATURES}) bf16"] = (fwd_bwd_step(plain, x, None, none), 50, False)
        for name, ctx in (("bf16", none), ("FP8", under_fp8)):
            linear = te.Linear(FEATURES, FEATURES, params_dtype=bf16, device=device)
            cases[f"te.Linear({FEATURES}) {name}"] = (fwd_bwd_step(linear, x, None, ctx), 50, False)
        plain_norm_linear = torch.nn.Sequential(torch.nn.LayerNorm(FEATURES, device=device, dtype=bf16), plain)
        cases[f"nn.LayerNorm + nn.Linear({FEATURES}) bf16"] = (fwd_bwd_step(plain_norm_linear, x, None, none), 50, False)
        norm_linear = te.LayerNormLinear(FEATURES, FEATURES, params_dtype=bf16, device=device)
        cases[f"te.LayerNormLinear({FEATURES}) bf16"] = (fwd_bwd_step(norm_linear, x, None, none), 50, False)
        plain_mlp = torch.nn.Sequential(torch.nn.LayerNorm(FEATURES, device=device, dtype=bf16),
                                        torch.nn.Linear(FEATURES, 4 * FEATURES, device=device, dtype=bf16),
                                        torch.nn.GELU(approximate="tanh"),
                                        torch.nn.Linear(4 * FEATURES, FEATURES, device=device, dtype=bf16))
        cases[f"nn.LayerNorm + MLP({FEATURES}) bf16"] = (fwd_bwd_step(plain_mlp, x, None, none), 50, False)
        mlp = te.LayerNormMLP(FEATURES, 4 * FEATURES, params_dtype=bf16, device=device)
        cases[f"te.LayerNormMLP({FEATURES}) bf16"] = (fwd_bwd_step(mlp, x, None, none), 50, False)
    if device != "cuda":
        return cases
    if "norms" in groups:
        x = torch.randn(16384, 4096, device=device, dtype=bf16, requires_grad=True)
        dy = torch.randn_like(x)
        for name, cls in (("te.LayerNorm", te.LayerNorm), ("te.RMSNorm", te.RMSNorm), ("nn.LayerNorm", torch.nn.LayerNorm)):
            cases[f"{name} [16384, 4096]"] = (fwd_bwd_step(cls(4096, device=device, dtype=bf16), x, dy, none), 50, False)
    recipes = (("large", "FP8", fp8), ("block", "FP8 block", Float8BlockScaling()), ("current", "FP8 current", Float8CurrentScaling()),
               ("mxfp8", "MXFP8", MXFP8BlockScaling()))
    for group, label, recipe in recipes:
        if group not in groups:
            continue
        context = functools.partial(te.autocast, recipe=recipe)
        x = torch.randn(8192, 8192, device=device, dtype=bf16, requires_grad=True)
        linear = te.Linear(8192, 8192, bias=False, params_dtype=bf16, device=device)
        cases[f"te.Linear 8192^3 {label}"] = (fwd_bwd_step(linear, x, torch.randn_like(x), context), 10, True)
        shape = LayerShape()
        xl = torch.randn(shape.seq, shape.batch, shape.hidden, device=device, dtype=bf16, requires_grad=True)
        cases[f"te.TransformerLayer {label}"] = (fwd_bwd_step(_te_layer(te, shape, device), xl, torch.randn_like(xl), context), 5, True)
        if group == "mxfp8":
            cases["te.TransformerLayer bf16"] = (fwd_bwd_step(_te_layer(te, shape, device), xl, torch.randn_like(xl), none), 5, True)
    if "layer1024" in groups:
        cases.update(_layer1024_cases(te, device, fp8))
    return cases


def _layer1024_cases(te, device: str, fp8) -> Dict[str, Tuple[Callable[[], None], int, bool]]:
    """The hidden-1024 layer's eager steps (bf16, FP8 delayed, FP8 current) and its compiled FP8 delayed step."""
    from transformer_engine.common.recipe import Float8CurrentScaling

    from _harness import under_autocast
    from bench_transformer_layer import LayerShape, _te_layer

    shape = LayerShape(hidden=1024, ffn=4096, heads=16, seq=512, batch=16)
    x = torch.randn(shape.seq, shape.batch, shape.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    cases = {}
    for label, recipe in (("bf16", None), ("FP8", fp8), ("FP8 current", Float8CurrentScaling())):
        context = contextlib.nullcontext if recipe is None else functools.partial(te.autocast, recipe=recipe)
        cases[f"layer 1024 {label} eager"] = (fwd_bwd_step(_te_layer(te, shape, device), x, dy, context), 10, False)
    layer = _te_layer(te, shape, device)
    compiled = torch.compile(under_autocast(layer, fp8))

    def compiled_step():
        compiled(x).backward(dy)
        layer.zero_grad(set_to_none=True)
        x.grad = None

    cases["layer 1024 FP8 compiled"] = (compiled_step, 10, False)
    return cases


def worker(groups, cpu, backend: str) -> None:
    """Pin to ``cpu`` (when given), build the cases, print READY and the library path, then answer each
    stdin line (a case name) with the microseconds per step of one chunk (under ``backend``'s policy)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
        torch.set_num_threads(1)  # one core: an intra-op thread pool would only contend for it
    import transformer_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with backend_policy(backend):
        cases = build_cases(groups, device)
        for step, _, _ in cases.values():  # warm-up: compiles, caches, allocator pools
            for _ in range(5):
                step()
        sync()
        print("READY", transformer_engine.__file__, "|".join(cases), flush=True)
        for line in sys.stdin:
            step, chunk, wait_each = cases[line.strip()]
            sync()
            start = time.perf_counter()
            for _ in range(chunk):
                step()
                if wait_each:
                    sync()
            sync()
            print(f"{(time.perf_counter() - start) / chunk * 1e6:.3f}", flush=True)


def _shared_cpu() -> list:
    """["--cpu", N] naming the one core both workers run on (the highest this process may use), or []
    where the platform cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    return ["--cpu", str(max(os.sched_getaffinity(0)))]


def _start(tree: Path, groups, backend: str) -> Tuple[subprocess.Popen, str, list]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT / "benchmarks")]), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, __file__, "--worker", "--groups", ",".join(groups), "--backend", backend, *_shared_cpu()],
                            env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("READY "):
            _, library, names = line.rstrip("\n").split(" ", 2)
            if not Path(library).resolve().is_relative_to(tree.resolve()):
                proc.kill()
                raise SystemExit(f"the worker for {tree} imported {library}: something ahead of PYTHONPATH (an editable "
                                 "install's import hook, say) picks the package; install it without -e, or uninstall it")
            return proc, library, names.split("|")
    raise SystemExit(f"the worker for {tree} exited before it was ready (exit code {proc.wait()})")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--base-tree", required=False, help="directory holding the base tree's transformer_engine package")
    parser.add_argument("--rounds", type=int, default=25, help="chunks per case and tree (at least 2)")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated subset of {GROUPS}")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    groups = [g for g in args.groups.split(",") if g]
    if args.worker:
        worker(groups, args.cpu, args.backend)
        return
    if not args.base_tree or not (Path(args.base_tree) / "transformer_engine").is_dir():
        raise SystemExit("--base-tree must name a directory holding a transformer_engine package (see the docstring)")
    if args.rounds < 2:
        raise SystemExit(f"--rounds {args.rounds}: the quartiles of the paired ratios need at least 2 rounds")
    trees = {"base": Path(args.base_tree).resolve(), "new": ROOT}
    workers = {name: _start(tree, groups, args.backend) for name, tree in trees.items()}
    cases = workers["new"][2]
    rows, results = [], {}
    try:
        for case in cases:
            times = {"base": [], "new": []}
            for r in range(args.rounds):
                for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                    proc = workers[name][0]
                    proc.stdin.write(case + "\n")
                    proc.stdin.flush()
                    times[name].append(float(proc.stdout.readline()))
            ratios = [new / base for base, new in zip(times["base"], times["new"])]
            q1, _, q3 = statistics.quantiles(ratios, n=4)
            results[case] = {"base_us": times["base"], "new_us": times["new"], "ratio_median": statistics.median(ratios),
                             "ratio_q1": q1, "ratio_q3": q3}
            rows.append([case, f"{statistics.median(times['base']):.1f}", f"{statistics.median(times['new']):.1f}",
                         f"{statistics.median(ratios):.3f}", f"{q1:.3f} - {q3:.3f}"])
    finally:
        for proc, _, _ in workers.values():
            proc.stdin.close()
            proc.wait()
    print_table(f"A/B, {args.rounds} chunks per case and tree, taking turns (us per step)",
                ["case", "base", "new", "new / base (median of pairs)", "quartiles"], rows)
    write_json(args.json, {"benchmark": "ab", "trees": {name: w[1] for name, w in workers.items()}, "rounds": args.rounds,
                           "cases": results})


if __name__ == "__main__":
    main()
