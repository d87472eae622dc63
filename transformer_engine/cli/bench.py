"""``te-fl bench``: run the benchmark suite of the source tree and print its tables.

On a GPU every benchmark runs at PERF.md's shapes. On a CPU only a smoke run is possible (the
dispatch overhead and the TransformerLayer at a tiny shape, time and ratio to plain PyTorch only):
CPU times say nothing about GPU speed; :data:`CPU_NOTE` says so first.
The benchmarks are the scripts in ``benchmarks/`` of a source checkout (an editable install finds
them); each prints a table and, with ``--json DIR``, writes ``DIR/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

__all__ = ["add_arguments", "run", "BENCHMARKS", "CPU_NOTE"]

#: What ``te-fl bench`` prints first on a machine without a CUDA GPU.
CPU_NOTE = """te-fl bench: no CUDA GPU, so only the CPU smoke runs. What they measure:
  dispatch  the Python cost of routing one op call to its implementation (host
            overhead, which every device pays per op call);
  layer     fwd+bwd time of a tiny TransformerLayer per variant and its ratio to
            plain PyTorch, FP8 emulated by the reference backend: a check that
            everything runs, not a speed result (no TFLOP/s or memory columns).
CPU times say nothing about GPU speed; the GPU-only benchmarks are skipped."""

# name -> (script, extra arguments on CPU or None when the benchmark needs a GPU)
BENCHMARKS: Dict[str, tuple] = {
    "dispatch": ("bench_dispatch.py", []),
    "layer": ("bench_transformer_layer.py", ["--small", "--iters", "3"]),
    "linear": ("bench_linear.py", None),
    "attention": ("bench_attention.py", None),
    "kernels": ("bench_kernels.py", None),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``te-fl bench``."""
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    parser.add_argument("--json", metavar="DIR", default=None, help="write one JSON file per benchmark into DIR")
    parser.add_argument("--plot", metavar="PNG", default=None, help="bar chart of the TransformerLayer variants (needs --json)")


def _benchmarks_dir() -> Path:
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "_harness.py").exists():
        raise SystemExit("te-fl bench: the benchmarks/ folder of a source checkout was not found; "
                         "clone the repository and install it with `pip install -e .`")
    return folder


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmarks one after the other; returns the number of failed ones."""
    import torch

    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"te-fl bench: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    if args.plot and not args.json:
        raise SystemExit("te-fl bench: --plot draws from the JSON results; add --json DIR")
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        print(CPU_NOTE)
    folder = _benchmarks_dir()
    out = Path(args.json).resolve() if args.json else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    failures = 0
    skipped = [n for n in names if not on_gpu and BENCHMARKS[n][1] is None]
    for name in names:
        script, cpu_args = BENCHMARKS[name]
        if name in skipped:
            continue
        cmd: List[str] = [sys.executable, str(folder / script)] + ([] if on_gpu else cpu_args)
        if out:
            cmd += ["--json", str(out / f"{name}.json")]
        print(f"\n[{name}] {' '.join(cmd[1:])}", flush=True)
        failures += subprocess.run(cmd, cwd=folder, env=_env_with_package(folder.parent)).returncode != 0
    if skipped:
        print(f"\nskipped (they need a CUDA GPU): {', '.join(skipped)}")
    if args.plot:
        _plot_layer(out / "layer.json", Path(args.plot))
    return failures


def _env_with_package(root: Path) -> Dict[str, str]:
    """The environment with this package's source root first on PYTHONPATH (scripts import it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    return env


def _plot_layer(results: Path, png: Path) -> None:
    if not results.exists():
        raise SystemExit(f"te-fl bench: {results} is missing; include 'layer' in --only to plot it")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())["results"]
    names = [n for n, r in data.items() if "ms" in r]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 1.5), dpi=120)
    ax.barh(names, [data[n]["ms"] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("fwd+bwd time (ms, lower is better)")
    ax.set_title("TransformerLayer benchmark")
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}")
