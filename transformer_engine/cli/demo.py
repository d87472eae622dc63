"""``te-fl demo``: train a small GPT in high precision and in FP8 from the same weights; show the curves.

Writes ``<out>/demo.json`` (every number), ``<out>/loss_curves.png`` and prints a table. The
default ``<out>`` is ``$XDG_CACHE_HOME/te-fl/demo`` (``~/.cache/te-fl/demo``), outside any source
tree; each run replaces the files there. A second high-precision run with another seed (``--bf16-seeds 2``,
the default on CPU and GPU) measures the seed-to-seed spread that FP8's loss gap is judged against.
On CPU the default (size ``tiny``, 200 steps, three runs) takes under a minute; on a GPU the
default size is ``large`` (hidden 4096, where FP8's GEMMs pay off in eager mode; both runs eager).
matplotlib (for the plot) is checked before any training; ``--no-plot`` skips the plot. Ctrl-C stops training and still writes what was
measured.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

from transformer_engine.common.env import read as read_env

__all__ = ["add_arguments", "default_out", "run"]


def default_out() -> Path:
    """``$XDG_CACHE_HOME/te-fl/demo``, or ``~/.cache/te-fl/demo``: outside the repository."""
    cache = read_env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "te-fl" / "demo"


def _recipe_type(runnable, unavailable):
    """argparse ``type`` of ``--recipe``: a runnable recipe name; the error names why another is refused."""

    def parse(name: str) -> str:
        if name in unavailable:
            raise argparse.ArgumentTypeError(f"recipe {name!r} cannot run: {unavailable[name]}; choose from {', '.join(runnable)}")
        if name not in runnable:
            raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(runnable)})")
        return name

    return parse


#: peak AdamW learning rate per size (wider models take smaller steps: the large one spikes at 1e-3)
_PEAK_LR = {"medium": 1e-3, "large": 3e-4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``te-fl demo``."""
    from transformer_engine.demo.model import SIZES
    from transformer_engine.demo.train import RECIPES, unavailable_recipes

    unavailable = unavailable_recipes()
    runnable = sorted(n for n in RECIPES if n not in unavailable)
    not_offered = "; ".join(f"not offered: {n} ({why})" for n, why in unavailable.items())
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model size (default: tiny on CPU, large on GPU)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 200 on CPU, 400 on GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and corpus (same seed, same result)")
    parser.add_argument("--recipe", type=_recipe_type(runnable, unavailable), default="delayed", metavar="{" + ",".join(runnable) + "}",
                        help="FP8 recipe of the FP8 run (default: delayed)" + (f"; {not_offered}" if not_offered else ""))
    parser.add_argument("--bf16-seeds", type=int, default=2, metavar="N",
                        help="high-precision runs (BF16 on GPU, FP32 on CPU) with seeds SEED..SEED+N-1; N >= 2 measures "
                             "their seed-to-seed spread of the validation loss (default: 2; 1 skips it, saving a run)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {default_out()})")
    parser.add_argument("--no-plot", action="store_true", help="skip loss_curves.png (no matplotlib needed)")


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
    size = args.size or ("large" if on_gpu else "tiny")
    steps = args.steps if args.steps is not None else (400 if on_gpu else 200)
    if steps < 1:
        raise SystemExit(f"te-fl demo: --steps must be >= 1, got {steps}")
    if args.bf16_seeds < 1:
        raise SystemExit(f"te-fl demo: --bf16-seeds must be >= 1 (the high-precision baseline), got {args.bf16_seeds}")
    out = _writable_folder(args.out or default_out())
    if not args.no_plot:
        _require("matplotlib", "the loss-curve plot", "pass --no-plot to skip the plot")
    cfg = DemoConfig(size=size, steps=steps, seed=args.seed, recipe=args.recipe, device=device,
                     lr=_PEAK_LR.get(size, 3e-3), eval_every=max(1, steps // 8),
                     hp_seeds=args.bf16_seeds)
    _check_recipe(cfg)
    results = _train_with_progress(cfg, run_demo)
    print_summary(results, cfg)
    extra = {"interrupted": any(r.interrupted for r in results), "environment": _environment()}
    written = [write_json(results, cfg, out / "demo.json", extra)]
    if args.no_plot:
        print("plot skipped (--no-plot)")
    else:
        written.append(write_plot(results, cfg, out / "loss_curves.png"))
    print(f"wrote {' and '.join(p.name for p in written)} in {out}")
    return 130 if extra["interrupted"] else 0


def _require(module: str, purpose: str, alternative: str) -> None:
    """Exit with an install hint when optional ``module`` is missing (checked before any training)."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise SystemExit(f"te-fl demo: {purpose} needs {module}, which is not installed: "
                         f"pip install {module} (or pip install -e '.[pytorch]'), or {alternative}")


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


def _print_progress(cfg):
    """Plain-text progress (rich missing): a line every tenth of a run."""
    every = max(1, cfg.steps // 10)

    def on_step(label, step, result):
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            print(f"{label}: step {step + 1}/{cfg.steps} loss {result.train_loss[-1]:.3f}", flush=True)

    return on_step


def _train_with_progress(cfg, run_demo):
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return run_demo(cfg, _print_progress(cfg))
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
