"""Presenting the demo: a summary table, the loss-curve plot (PNG) and all numbers as JSON.

The table fits 80 columns: one row per run with the final validation loss, its difference to the
first (high-precision) run, the median step time after warm-up and its interquartile range, tokens/s
from that median, FP8's speed-up (ratio of median step times) and, on a GPU, the peak memory (GiB). Two lines
under it state FP8's loss gap next to the high-precision seed-to-seed spread, and how speed was measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

from .train import DemoConfig, RunResult

__all__ = ["HEADERS", "fidelity", "summary_rows", "summary_notes", "print_summary", "write_plot", "write_json"]

#: Column headers (short, so that the table fits 80 columns); "GiB" (peak memory) is shown on GPUs only.
HEADERS = ["run", "valid", "vs first", "step ms", "IQR", "tokens/s", "speed-up", "GiB"]


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _tokens(value: float) -> str:
    """Tokens/s in at most 6 characters: 950, 33.1k, 243.0k, 1.22M."""
    if math.isnan(value):
        return "n/a"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    return f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def _ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    if numerator is None or denominator is None or math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return None
    return numerator / denominator


def fidelity(results: List[RunResult]) -> dict:
    """FP8's final validation-loss gap to the high-precision run of the same seed, and the spread of the
    high-precision runs over seeds (max - min of their final validation losses), in nats and relative.

    Also the speed-up of FP8: the high-precision run's median step time / FP8's.
    """
    base = results[0]
    base_valid = base.final_valid_loss
    fp8 = next((r for r in results if r.precision == "fp8"), None)
    hp = [r for r in results if r.precision == "high" and r.final_valid_loss is not None]
    gap = None if fp8 is None or fp8.final_valid_loss is None or base_valid is None else fp8.final_valid_loss - base_valid
    spread = max(r.final_valid_loss for r in hp) - min(r.final_valid_loss for r in hp) if len(hp) >= 2 else None
    return {
        "fp8_valid_gap": {"nats": gap, "relative": _ratio(gap, base_valid)},
        "hp_seed_spread": {
            "seeds": [r.seed for r in hp],
            "final_valid_loss": [r.final_valid_loss for r in hp],
            "nats": spread,
            "relative": _ratio(spread, base_valid),
        },
        "speedup": None if fp8 is None else _ratio(base.step_seconds_median, fp8.step_seconds_median),
        "warmup_steps": base.warmup_steps,
    }


def summary_rows(results: List[RunResult], with_memory: bool = False) -> List[List[str]]:
    """One row per run, the columns of :data:`HEADERS` (``GiB`` only ``with_memory``)."""
    base = results[0]
    rows = []
    for r in results:
        valid, base_valid = r.final_valid_loss, base.final_valid_loss
        gap = None if r is base or valid is None or base_valid is None else valid - base_valid
        speed = _ratio(base.step_seconds_median, r.step_seconds_median)
        row = [
            r.label + ("*" if r.interrupted else ""),
            _fmt(valid, ".4f"),
            "" if r is base else _fmt(gap, "+.4f"),
            _fmt(r.step_seconds_median * 1e3, ".1f"),
            _fmt((r.step_seconds_q3 - r.step_seconds_q1) * 1e3, ".1f"),
            _tokens(r.tokens_per_second),
            "" if r.precision != "fp8" else _fmt(speed, ".2f") + ("x" if speed is not None else ""),
        ]
        if with_memory:
            row.append(_fmt(None if r.peak_memory_bytes is None else r.peak_memory_bytes / 2**30, ".2f"))
        rows.append(row)
    return rows


def _nats(value: Optional[float], relative: Optional[float], signed: bool) -> str:
    if value is None:
        return "n/a"
    text = format(value, "+.4f" if signed else ".4f") + " nats"
    return text + ("" if relative is None else f" ({relative * 100:{'+' if signed else ''}.2f}%)")


def summary_notes(results: List[RunResult], cfg: DemoConfig) -> List[str]:
    """The lines under the table: fidelity (FP8 gap vs seed spread) and how speed was measured."""
    f = fidelity(results)
    base = results[0]
    gap, spread = f["fp8_valid_gap"], f["hp_seed_spread"]
    if spread["nats"] is None:
        spread_text = f"{base.label} seed spread: not measured (--bf16-seeds 2 measures it)"
    else:
        seeds = spread["seeds"]
        spread_text = f"{base.label} spread over seeds {seeds[0]}-{seeds[-1]}: {_nats(spread['nats'], spread['relative'], signed=False)}"
    stopped = ["* stopped by Ctrl-C: its numbers cover the steps it ran"] if any(r.interrupted for r in results) else []
    return stopped + [
        f"FP8 final valid loss vs {base.label}: {_nats(gap['nats'], gap['relative'], signed=True)}",
        spread_text,
        f"step ms: median of steps {base.warmup_steps + 1}-{len(base.step_seconds)} "
        f"({base.warmup_steps} warm-up steps left out); IQR: q3 - q1",
        f"speed-up: {base.label} median step time / FP8's; tokens/s from the median",
    ]


def _title(cfg: DemoConfig) -> str:
    return f"te-fl demo: {cfg.size} GPT, {cfg.steps} steps, {cfg.device}, FP8 recipe {cfg.recipe}"


def print_summary(results: List[RunResult], cfg: DemoConfig, console=None) -> None:
    """Print the table and its notes with rich (plain text when rich is missing)."""
    with_memory = any(r.peak_memory_bytes is not None for r in results)
    headers = list(HEADERS if with_memory else HEADERS[:-1])
    headers[2] = f"vs {results[0].label}"
    rows = summary_rows(results, with_memory)
    notes = summary_notes(results, cfg)
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(row[i]) for row in [headers] + rows) for i in range(len(headers))]
        print(_title(cfg))
        for row in [headers] + rows:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        print("\n".join(notes))
        return
    table = Table(title=_title(cfg), box=box.SIMPLE_HEAD, show_edge=False)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i > 0, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console = console or Console()
    console.print(table)
    for note in notes:
        console.print(note, highlight=False)


def _smooth(values: List[float]) -> List[float]:
    window = max(1, len(values) // 50)
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def _shade_seed_spread(ax, runs: List[RunResult]) -> None:
    """Shade between the lowest and highest curve of the high-precision runs (train and validation)."""
    if len(runs) < 2:
        return
    n = min(len(r.train_loss) for r in runs)
    curves = [_smooth(r.train_loss)[:n] for r in runs]
    label = f"{runs[0].label} seed spread ({len(runs)} seeds)"
    ax.fill_between(range(1, n + 1), [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                    color="C0", alpha=0.25, linewidth=0, label=label)
    points = min(len(r.valid_loss) for r in runs)
    if points:
        steps = [s for s, _ in runs[0].valid_loss[:points]]
        losses = [[v for _, v in r.valid_loss[:points]] for r in runs]
        ax.fill_between(steps, [min(v) for v in zip(*losses)], [max(v) for v in zip(*losses)], color="C0", alpha=0.15, linewidth=0)


def write_plot(results: List[RunResult], cfg: DemoConfig, path: Path) -> Path:
    """Loss curves (train, smoothed; validation, markers) of the same-seed runs, the spread of the
    high-precision seeds shaded, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    _shade_seed_spread(ax, [r for r in results if r.precision == "high"])
    for r in results:
        if r.seed != results[0].seed:
            continue  # the other seeds are the shaded band
        (line,) = ax.plot(range(1, len(r.train_loss) + 1), _smooth(r.train_loss), label=f"{r.label} train", linewidth=1.5)
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
    """Every number of the demo, with its configuration and the summary (:func:`fidelity`)."""
    payload = {"config": cfg.__dict__, "summary": fidelity(results), "runs": [r.as_dict() for r in results], **extra}
    path.write_text(json.dumps(payload, indent=2))
    return path
