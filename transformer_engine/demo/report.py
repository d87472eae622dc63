"""Presenting the demo: a summary table, the loss-curve plot (PNG) and all numbers as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

from .train import DemoConfig, RunResult

__all__ = ["summary_rows", "print_summary", "write_plot", "write_json"]


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def summary_rows(results: List[RunResult]) -> List[List[str]]:
    """One row per run: label, final train loss, final validation loss, tokens/s, peak memory, loss gap."""
    base = results[0]
    rows = []
    for r in results:
        train = r.train_loss[-1] if r.train_loss else None
        valid = r.valid_loss[-1][1] if r.valid_loss else None
        base_valid = base.valid_loss[-1][1] if base.valid_loss else None
        gap = None if r is base or valid is None or base_valid is None else valid - base_valid
        memory = None if r.peak_memory_bytes is None else r.peak_memory_bytes / 2**20
        speed = None if r is base or math.isnan(base.tokens_per_second) else r.tokens_per_second / base.tokens_per_second
        rows.append([
            r.label + (" (interrupted)" if r.interrupted else ""),
            _fmt(train, ".4f"),
            _fmt(valid, ".4f"),
            _fmt(r.tokens_per_second, ",.0f"),
            _fmt(speed, ".2f") + ("x" if speed is not None else ""),
            _fmt(memory, ",.0f"),
            _fmt(gap, "+.4f"),
        ])
    return rows


HEADERS = ["run", "train loss", "valid loss", "tokens/s", "speed-up", "peak MiB", "valid gap vs first"]


def print_summary(results: List[RunResult], cfg: DemoConfig, console=None) -> None:
    """Print the table with rich (plain text when rich is missing)."""
    rows = summary_rows(results)
    title = f"te-fl demo: size={cfg.size}, steps={cfg.steps}, device={cfg.device}, recipe={cfg.recipe}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in [HEADERS] + rows:
            print(" | ".join(f"{c:>12}" for c in row))
        return
    table = Table(title=title)
    for header in HEADERS:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*row)
    (console or Console()).print(table)


def write_plot(results: List[RunResult], cfg: DemoConfig, path: Path) -> Path:
    """Loss curves (train, smoothed; validation, markers) of every run, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for r in results:
        steps = range(1, len(r.train_loss) + 1)
        window = max(1, len(r.train_loss) // 50)
        smooth = [sum(r.train_loss[max(0, i - window + 1) : i + 1]) / len(r.train_loss[max(0, i - window + 1) : i + 1]) for i in range(len(r.train_loss))]
        (line,) = ax.plot(list(steps), smooth, label=f"{r.label} train", linewidth=1.5)
        if r.valid_loss:
            vs, vl = zip(*r.valid_loss)
            ax.plot(vs, vl, "o--", color=line.get_color(), label=f"{r.label} valid", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.set_title(f"FP8 vs high precision: {cfg.size} GPT, {cfg.device}, recipe {cfg.recipe}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_json(results: List[RunResult], cfg: DemoConfig, path: Path, extra: dict) -> Path:
    """Every number of the demo, with its configuration."""
    payload = {"config": cfg.__dict__, "runs": [r.as_dict() for r in results], **extra}
    path.write_text(json.dumps(payload, indent=2))
    return path
