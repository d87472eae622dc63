"""``te-fl``: the command line of TransformerEngine-FL (``python -m transformer_engine`` is the same).

    te-fl info            what runs where: versions, device, recipes, backends, policy, dispatch table
    te-fl info --json     the same as JSON
    te-fl demo            FP8 vs high-precision training of a small GPT, with loss curves
    te-fl bench           the benchmark tables (docs/performance.md holds the H200 numbers)

Each subcommand is one module with ``add_arguments(parser)`` and ``run(args) -> int`` (the exit
code); adding a subcommand is one entry in ``_SUBCOMMANDS``. A subcommand's module is imported only
when that subcommand runs (or prints its help), so ``te-fl info`` never pays for another's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Dict, List, Optional, Tuple

__all__ = ["main"]

# name -> (module, one-line help)
_SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "info": ("transformer_engine.cli.info", "versions, device, FP8 recipes, backends, policy and the per-op dispatch table"),
    "demo": ("transformer_engine.cli.demo", "train a small GPT in high precision and in FP8 from the same weights"),
    "bench": ("transformer_engine.cli.bench", "run the benchmark suite and print its tables (CPU: smoke run only)"),
}


def _parser(selected: Optional[str]) -> argparse.ArgumentParser:
    from transformer_engine import __version__

    parser = argparse.ArgumentParser(prog="te-fl", description="TransformerEngine-FL command line.")
    parser.add_argument("--version", action="version", version=f"TE-FL {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``te-fl`` with ``argv`` (default: the process arguments); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = _parser(selected if selected in _SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(f"te-fl: choose a command: {', '.join(_SUBCOMMANDS)} (te-fl --help for more)", file=sys.stderr)
        return 2
    return importlib.import_module(_SUBCOMMANDS[args.command][0]).run(args)
