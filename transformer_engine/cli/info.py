"""``te-fl info``: what TE-FL sees on this machine and which implementation runs each op.

Prints: the TE-FL, Python, PyTorch and Triton versions; the devices (CPU, and each CUDA GPU with its compute
capability); which FP8 recipes can run and why not; where JAX is installed, the platform it compiles for and how
``transformer_engine.jax`` runs attention there; the backends and plugins that were loaded, with their load errors;
the active selection policy; every environment variable declared in the registry (``transformer_engine.common.env``:
the ``TE_FL_*`` settings, the ``NVTE_*`` recipe defaults, ``TRITON_INTERPRET``, ...; value or default, meaning;
unknown ``TE_FL_*`` ones flagged); and, for the CPU and (when present) the first CUDA GPU, the per-op dispatch
table: the implementation chosen and why each other one was passed over. ``--json`` prints the same information as
JSON. Tables use ``rich`` when it is installed, plain text otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import platform
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from transformer_engine.common.env import NAMESPACES, describe
from transformer_engine.common.env import read as read_env

__all__ = ["add_arguments", "run", "collect"]

# (recipe family, the transformer_engine.pytorch query that says whether it can run here)
_RECIPES: Tuple[Tuple[str, str], ...] = (
    ("FP8 per tensor (DelayedScaling, Float8CurrentScaling)", "is_fp8_available"),
    ("MXFP8 (MXFP8BlockScaling)", "is_mxfp8_available"),
    ("FP8 blocks (Float8BlockScaling)", "is_fp8_block_scaling_available"),
    ("NVFP4 (NVFP4BlockScaling)", "is_nvfp4_available"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``te-fl info``."""
    parser.add_argument("--json", action="store_true", help="print the same information as JSON")
    parser.add_argument("--op", action="append", metavar="NAME", help="show only this op in the dispatch table (repeatable)")


def run(args: argparse.Namespace) -> int:
    """Print the report; returns the exit code (2 for an unknown op name)."""
    try:
        info = collect(args.op)
    except KeyError as exc:
        print(f"te-fl info: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _render(_sections(info))
    return 0


def collect(op_names: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Everything ``te-fl info`` reports, as JSON-ready data (``op_names`` limits the dispatch table).

    Raises:
        KeyError: an unknown op name (the message suggests close ones).
    """
    from transformer_engine.plugin.core import get_default_manager, get_spec

    for name in op_names or ():
        get_spec(name)
    manager = get_default_manager()
    manager.ensure_initialized()
    devices = _devices()
    return {
        "versions": _versions(),
        "devices": devices,
        "recipes": _recipes(),
        "jax": _jax(),
        "backends": [dataclasses.asdict(record) for record in manager.plugin_records],
        "policy": _policy(),
        "settings": _settings(),
        "dispatch": _dispatch(manager, devices, op_names),
    }


# -- collecting ------------------------------------------------------------------------------------
def _module_version(name: str) -> Optional[str]:
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - absent or broken: reported as not installed
        return None
    return str(getattr(module, "__version__", "unknown"))


def _versions() -> Dict[str, Optional[str]]:
    from transformer_engine import __version__

    return {
        "te_fl": __version__,
        "python": platform.python_version(),
        "torch": _module_version("torch"),
        "triton": _module_version("triton"),
    }


def _devices() -> List[Dict[str, Any]]:
    devices = [{"type": "cpu", "index": None, "name": platform.processor() or platform.machine(), "compute_capability": None}]
    try:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch or a broken CUDA setup: CPU only
        return devices
    for index in range(count):
        major, minor = torch.cuda.get_device_capability(index)
        devices.append({"type": "cuda", "index": index, "name": torch.cuda.get_device_name(index),
                        "compute_capability": f"{major}.{minor}"})
    return devices


def _recipes() -> List[Dict[str, Any]]:
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - the report must still print
        why = f"transformer_engine.pytorch cannot be imported ({type(exc).__name__}: {exc})"
        return [{"recipe": name, "available": False, "reason": why} for name, _ in _RECIPES]
    rows = []
    for name, query in _RECIPES:
        try:
            available, reason = getattr(te, query)(return_reason=True)
        except Exception as exc:  # noqa: BLE001
            available, reason = False, f"{query}() failed ({type(exc).__name__}: {exc})"
        rows.append({"recipe": name, "available": bool(available), "reason": str(reason or "")})
    return rows


def _policy() -> Dict[str, Any]:
    from transformer_engine.plugin.core import get_policy

    policy = get_policy()
    return {
        "prefer": policy.prefer,
        "strict": policy.strict,
        "per_op": {op: list(tokens) for op, tokens in policy.per_op_order},
        "allow_vendors": sorted(policy.allow_vendors) if policy.allow_vendors is not None else None,
        "deny_vendors": sorted(policy.deny_vendors),
        "environment": {row["set_as"]: row["value"] for row in _settings() if row["set_as"] and _is_te_fl(row["name"])},
    }


def _settings() -> List[Dict[str, Any]]:
    """Every declared variable (value, default, meaning): TE-FL's ``TE_FL_*`` ones, NVIDIA TE's ``NVTE_*`` recipe
    defaults and the other programs' ones TE-FL reads (``TRITON_INTERPRET``, ...); then the unknown ``TE_FL_*`` ones set."""
    return describe()


def _is_te_fl(name: str) -> bool:
    """A variable of TE-FL's own namespace (what the selection policy reads, or an unknown name in it)."""
    return name.upper().startswith(NAMESPACES)


def _dispatch(manager, devices: List[Dict[str, Any]], op_names: Optional[Sequence[str]]) -> Dict[str, Any]:
    targets = [("cpu", None)] + [("cuda", d["index"]) for d in devices if d["type"] == "cuda"][:1]
    tables = {}
    for device_type, index in targets:
        table = manager.describe(device_type, None, index)
        tables[device_type] = {op: _op_entry(rows) for op, rows in table.items() if not op_names or op in op_names}
    return tables


def _op_entry(decisions) -> Dict[str, Any]:
    chosen = next((d for d in decisions if d.status == "selected"), None)
    conditional = [d.impl_id for d in decisions if d.status == "conditional"]
    return {"selected": chosen.impl_id if chosen else None, "conditional": conditional,
            "candidates": [dataclasses.asdict(d) for d in decisions]}


# -- rendering ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Section:
    title: str
    headers: Tuple[str, ...]
    rows: List[Tuple[str, ...]]


def _jax() -> Optional[Dict[str, Any]]:
    """JAX's version, the platform it compiles for and how ``transformer_engine.jax`` runs attention and FP8 there
    (None where JAX is not installed)."""
    if importlib.util.find_spec("jax") is None:
        return None
    try:
        import jax

        backend = jax.default_backend()
    except Exception as exc:  # noqa: BLE001 - a broken JAX install is reported, not raised
        return {"version": _module_version("jax"), "backend": None, "attention": f"JAX cannot start ({type(exc).__name__}: {exc})",
                "fp8_compile": "-"}
    if backend not in ("gpu", "cuda"):
        return {"version": jax.__version__, "backend": backend, "attention": f"einsum path (the {backend} backend has no cuDNN)",
                "fp8_compile": "-"}
    triton_gemm_off = "--xla_gpu_enable_triton_gemm=false" in (read_env("XLA_FLAGS") or "")
    return {
        "version": jax.__version__, "backend": backend,
        "attention": "cuDNN fused attention (jax.nn.dot_product_attention) for the calls transformer_engine.jax.attention."
                     "cudnn_gap accepts (bf16 / fp16, head size <= 128, no dropout, bias, padding or window); the einsum path otherwise",
        "fp8_compile": "XLA_FLAGS has --xla_gpu_enable_triton_gemm=false: FP8 steps compile in seconds" if triton_gemm_off else
                       "XLA autotunes Triton fusions around every FP8 dot (minutes per layer); set "
                       "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (README)",
    }


def _sections(info: Dict[str, Any]) -> List[_Section]:
    v = info["versions"]
    sections = [
        _Section("TE-FL", ("component", "version"), [
            ("TE-FL", v["te_fl"]), ("python", v["python"]),
            ("torch", v["torch"] or "not installed"), ("triton", v["triton"] or "not installed"),
        ]),
        _Section("Devices", ("device", "name", "compute capability"), [
            (d["type"] if d["index"] is None else f"{d['type']}:{d['index']}", d["name"], d["compute_capability"] or "-")
            for d in info["devices"]
        ]),
        _Section("FP8 recipes", ("recipe", "status"), [
            (r["recipe"], ("available" + (f": {r['reason']}" if r["reason"] else "")) if r["available"] else f"unavailable: {r['reason']}")
            for r in info["recipes"]
        ]),
        _Section("JAX", ("item", "value"), _jax_rows(info["jax"])),
        _Section("Backends and plugins", ("name", "source", "status", "impl ids"), [
            (b["name"], b["source"], f"loaded ({b['ops']} impls)" if b["ok"] else f"failed: {b['error']}", ", ".join(b["impl_ids"]) or "-")
            for b in info["backends"]
        ]),
        _Section("Policy", ("setting", "value"), _policy_rows(info["policy"])),
        _Section("Settings (environment)", ("variable", "value", "meaning"), [_setting_row(row) for row in info["settings"]]),
    ]
    for device, table in info["dispatch"].items():
        sections.append(_Section(f"Dispatch on {device}", ("op", "runs", "passed over"),
                                 [_dispatch_row(op, entry) for op, entry in table.items()]))
    return sections


def _jax_rows(jax_info: Optional[Dict[str, Any]]) -> List[Tuple[str, str]]:
    if jax_info is None:
        return [("jax", "not installed")]
    return [("jax", jax_info["version"] or "unknown"), ("compiles for", jax_info["backend"] or "-"),
            ("attention", jax_info["attention"]), ("FP8 compile", jax_info["fp8_compile"])]


def _policy_rows(policy: Dict[str, Any]) -> List[Tuple[str, str]]:
    per_op = "; ".join(f"{op}={'|'.join(tokens)}" for op, tokens in policy["per_op"].items())
    rows = [
        ("prefer", policy["prefer"]),
        ("strict",
         "yes: an implementation's error propagates" if policy["strict"] else "no: an error falls back to the next implementation"),
        ("per-op order", per_op or "none"),
        ("allowed vendors", "all" if policy["allow_vendors"] is None else ", ".join(policy["allow_vendors"]) or "none"),
        ("denied vendors", ", ".join(policy["deny_vendors"]) or "none"),
    ]
    return rows


def _setting_row(row: Dict[str, Any]) -> Tuple[str, str, str]:
    name = row["name"] if row["set_as"] in (None, row["name"]) else f"{row['name']} (set as {row['set_as']}, deprecated)"
    value = row["value"] if row["value"] is not None else f"unset ({row['default']})"
    scope = "" if row["scope"] in ("library", "unknown") else f" [{row['scope']} only]"
    return name, value, row["description"] + scope


def _dispatch_row(op: str, entry: Dict[str, Any]) -> Tuple[str, str, str]:
    runs_first = [entry["selected"]] + entry["conditional"]
    others = [c for c in entry["candidates"] if c["impl_id"] not in runs_first]
    passed = "; ".join(f"{c['impl_id']}: {c['reason']}" for c in others) or "-"
    runs = entry["selected"] or "nothing (no implementation)"
    if entry["conditional"]:
        runs = ", ".join(f"{i} if its supports() accepts" for i in entry["conditional"]) + f", else {runs}"
    return op, runs, passed


def _render(sections: List[_Section]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        _render_plain(sections)
        return
    console = Console()
    for section in sections:
        table = Table(title=section.title, title_justify="left", title_style="bold")
        for header in section.headers:
            table.add_column(header, overflow="fold")
        for row in section.rows:
            table.add_row(*(Text(str(cell)) for cell in row))  # Text: no markup parsing of "[...]"
        console.print(table)


def _render_plain(sections: List[_Section]) -> None:
    for section in sections:
        cells = [section.headers] + [tuple(str(c) for c in row) for row in section.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(section.headers) - 1)]
        print(f"\n{section.title}")
        for row in cells:
            print("  " + "  ".join([c.ljust(w) for c, w in zip(row, widths)] + [row[-1]]))
