"""``te-fl demo``: train a small GPT in high precision and in FP8 from the same weights; show the curves.

Writes ``<out>/demo.json`` (every number), ``<out>/loss_curves.png`` and prints a table. On CPU the
default (size ``tiny``, 200 steps) takes about two minutes; on a GPU the default size is ``medium``.
Ctrl-C stops training and still writes what was measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

__all__ = ["add_arguments", "run"]

_DEFAULT_OUT = "te-fl-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``te-fl demo``."""
    from transformer_engine.demo.model import SIZES
    from transformer_engine.demo.train import RECIPES

    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default: tiny on CPU, medium on GPU)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 200 on CPU, 400 on GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and corpus (same seed, same result)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="delayed", help="FP8 recipe of the FP8 run")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--out", default=_DEFAULT_OUT, help=f"output folder (default: ./{_DEFAULT_OUT})")


def _resolve_device(name):
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"te-fl demo: unknown device {name!r}; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"te-fl demo: device {name!r} is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("te-fl demo: --device cuda asked for, but PyTorch sees no CUDA GPU; use --device cpu")
    return name


def _writable_folder(path: str) -> Path:
    folder = Path(path).expanduser().resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise SystemExit(f"te-fl demo: cannot write to output folder {folder}: {exc.strerror or exc}")
    return folder


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code (130 after Ctrl-C)."""
    from transformer_engine.demo.report import print_summary, write_json, write_plot
    from transformer_engine.demo.train import DemoConfig, run_demo

    device = _resolve_device(args.device)
    on_gpu = device.startswith("cuda")
    size = args.size or ("medium" if on_gpu else "tiny")
    steps = args.steps if args.steps is not None else (400 if on_gpu else 200)
    if steps < 1:
        raise SystemExit(f"te-fl demo: --steps must be >= 1, got {steps}")
    out = _writable_folder(args.out)
    cfg = DemoConfig(size=size, steps=steps, seed=args.seed, recipe=args.recipe, device=device,
                     lr=1e-3 if size in ("medium", "large") else 3e-3, eval_every=max(1, steps // 8))
    _check_recipe(cfg)
    results = _train_with_progress(cfg, run_demo)
    print_summary(results, cfg)
    extra = {"interrupted": any(r.interrupted for r in results), "environment": _environment()}
    json_path = write_json(results, cfg, out / "demo.json", extra)
    png_path = write_plot(results, cfg, out / "loss_curves.png")
    print(f"wrote {json_path} and {png_path}")
    return 130 if extra["interrupted"] else 0


def _check_recipe(cfg) -> None:
    """Fail before training when the chosen recipe cannot run on this device."""
    import torch

    import transformer_engine.pytorch as te
    from transformer_engine.demo.train import make_recipe

    probe = te.Linear(16, 16, device=cfg.device)
    try:
        with te.autocast(recipe=make_recipe(cfg.recipe)):
            probe(torch.randn(16, 16, device=cfg.device))
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        raise SystemExit(f"te-fl demo: recipe {cfg.recipe!r} cannot run on {cfg.device}: {exc}")


def _train_with_progress(cfg, run_demo):
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return run_demo(cfg)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn()]
    with Progress(*columns, transient=False) as progress:
        tasks = {}

        def on_step(label, step, result):
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=cfg.steps, loss="-")
            progress.update(tasks[label], completed=step + 1, loss=f"{result.train_loss[-1]:.3f}")

        return run_demo(cfg, on_step)


def _environment() -> dict:
    import platform

    import torch

    import transformer_engine

    info = {"te_fl": transformer_engine.__version__, "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["argv"] = sys.argv[1:]
    return info
