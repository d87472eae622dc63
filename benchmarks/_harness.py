"""Shared benchmark plumbing: timing, peak memory, result tables and JSON, spawned ranks for the distributed ones.

Timing follows PERF.md: warm-up first, CUDA events around each iteration, median of many
iterations; on CPU a perf_counter median (CPU numbers say nothing about GPU speed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["fwd_bwd_step", "time_fn", "time_back_to_back", "host_ms", "peak_memory", "print_table", "write_json", "base_parser",
           "environment", "backend_policy", "under_autocast"]


def fwd_bwd_step(module: torch.nn.Module, x: torch.Tensor, dy: Optional[torch.Tensor],
                 context_factory: Callable[[], object]) -> Callable[[], None]:
    """One training step: y = module(x) under ``context_factory()``, y.backward(dy) (ones when ``dy`` is
    None), then the parameter and input gradients cleared, so every call does the same work."""

    def step():
        with context_factory():
            y = module(x)
        y.backward(torch.ones_like(y) if dy is None else dy)
        module.zero_grad(set_to_none=True)
        x.grad = None

    return step


def time_fn(fn: Callable[[], object], warmup: int = 5, iters: int = 20, device: Optional[torch.device] = None) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs."""
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    for _ in range(warmup):
        fn()
    times: List[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_back_to_back(fn: Callable[[], object], warmup: int = 5, iters: int = 20, device: Optional[torch.device] = None) -> float:
    """Milliseconds per call of ``fn()`` over ``iters`` calls enqueued one after another (CUDA events around
    all of them, one wait at the end): the steady state of a training loop, where the host runs ahead and
    the GPU never idles between steps; on CPU the mean wall time."""
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def host_ms(step: Callable[[], object], device: str, repeats: int = 10) -> float:
    """Median CPU milliseconds to issue one ``step()``, starting each from an idle GPU."""
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def under_autocast(module: Callable, recipe) -> Callable:
    """``module`` itself for recipe None, else a function calling it inside ``te.autocast(recipe=recipe)``."""
    if recipe is None:
        return module
    import transformer_engine.pytorch as te

    def forward(*args):
        with te.autocast(recipe=recipe):
            return module(*args)

    return forward


def peak_memory(fn: Callable[[], object], device: Optional[torch.device] = None) -> Optional[int]:
    """Peak bytes allocated on the CUDA device while ``fn()`` runs once (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain fixed-width table (it goes to logs and to docs/performance.md as is)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def environment() -> Dict[str, object]:
    """Date, git revision, versions and device of this run."""
    rev = os.environ.get("TE_FL_REVISION", "")  # set by scripts/gpu_check.sh callers: the GPU copy has no .git
    if not rev:
        try:
            rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            rev = ""
    env = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "revision": rev or "unknown",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def write_json(path: Optional[str], payload: Dict[str, object]) -> None:
    """Write ``payload`` plus the environment to ``path`` (when given)."""
    if path:
        Path(path).write_text(json.dumps({"environment": environment(), **payload}, indent=2, default=str))
        print(f"wrote {path}")


def base_parser(description: str) -> argparse.ArgumentParser:
    """Parser with the options every benchmark shares: --json and --backend."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    parser.add_argument("--backend", choices=["default", "flagos", "vendor", "reference"], default="default",
                        help="pin the preferred backend kind (default: the library's own policy)")
    return parser


def backend_policy(name: str):
    """Context manager that pins the preferred backend kind (a no-op for "default")."""
    import contextlib

    from transformer_engine.plugin.core import with_preference

    return contextlib.nullcontext() if name == "default" else with_preference(name)


def spawn_ranks(rank_main: Callable, size: int, args, name: str) -> None:
    """``rank_main(rank, size, args, init_file)`` on ``size`` spawned processes that meet through a fresh file://
    rendezvous; under nccl (``args.dist_backend``) each takes one GPU, so ``size`` GPUs must be there."""
    import tempfile

    import torch.multiprocessing as mp

    if args.dist_backend == "nccl" and torch.cuda.device_count() < size:
        raise SystemExit(f"--{name} {size} needs {size} GPUs, found {torch.cuda.device_count()}")
    fd, init_file = tempfile.mkstemp(prefix=f"bench_{name}_")
    os.close(fd)
    os.unlink(init_file)
    mp.spawn(rank_main, args=(size, args, init_file), nprocs=size)


def init_rank(rank: int, size: int, backend: str, init_file: str) -> torch.device:
    """Join the process group of :func:`spawn_ranks` (NVLink multicast off, as the lent machines need); this rank's
    device: GPU ``rank`` under nccl, else the CPU."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size)
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
