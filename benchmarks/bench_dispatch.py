"""Python overhead of dispatching one op: ``ops.<name>(x)`` / ``manager.call`` vs calling the impl directly.

The op is ``relu`` with a trivial implementation (it returns its input) on a 4-element CPU tensor, so
what is measured is the dispatch layer itself: reading the policy, the cache lookup by
(policy, registry epoch, device, dtype) and the call into the impl. Two impls are registered so the
fallback mode has a fallback candidate; strict mode runs the first impl with no fallback.

Each variant is timed ``--iters`` calls at a time, ``--repeats`` times, round-robin across variants
(so a noisy neighbour slows them all alike); the table shows the median and the minimum per call and
the overhead = median(variant) - median(direct call). The default clock is the thread's CPU time,
which leaves out the time the thread waits for a core on a shared machine (``--clock wall`` for
wall time).

    python benchmarks/bench_dispatch.py --json dispatch.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from typing import Callable, Dict, List

import torch
from _harness import print_table, write_json

from transformer_engine.plugin._ops import OpNamespace
from transformer_engine.plugin.core import BackendImplKind, OpImpl, OpManager, OpRegistry, with_strict_mode


def relu(x):
    """The trivial impl: all the time above a plain call of it is dispatch overhead."""
    return x


def _fallback_relu(x):
    return x


def _setup():
    registry = OpRegistry()
    registry.register_many(
        [
            OpImpl("relu", "flagos.bench", BackendImplKind.DEFAULT, relu),
            OpImpl("relu", "reference.bench", BackendImplKind.REFERENCE, _fallback_relu),
        ]
    )
    manager = OpManager(registry, load_builtins=False, discover=False)
    return manager, OpNamespace(manager), torch.zeros(4)


_CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
_VARIANTS = {
    "direct impl(x)": "relu(x)",
    "ops.relu(x)": "ops.relu(x)",
    'manager.call("relu", x)': 'manager.call("relu", x)',
}


def measure(iters: int, repeats: int, clock: Callable[[], float]) -> List[Dict[str, object]]:
    """One row per (mode, variant): median and min ns per call, overhead over the direct call."""
    manager, ops, x = _setup()
    namespace = {"relu": relu, "ops": ops, "manager": manager, "x": x}
    rows = []
    for mode in ("fallback", "strict"):
        with with_strict_mode(mode == "strict"):
            assert ops.relu(x) is x and manager.select("relu", x).impl_id == "flagos.bench"
            timers = {name: timeit.Timer(stmt, timer=clock, globals=namespace) for name, stmt in _VARIANTS.items()}
            samples: Dict[str, List[float]] = {name: [] for name in timers}
            for timer in timers.values():
                timer.timeit(iters // 10)  # warm-up (and the plan cache)
            for _ in range(repeats):
                for name, timer in timers.items():
                    samples[name].append(timer.timeit(iters) / iters * 1e9)
        base = statistics.median(samples["direct impl(x)"])
        for name, values in samples.items():
            median = statistics.median(values)
            rows.append(
                {"mode": mode, "variant": name, "median_ns": round(median, 1), "min_ns": round(min(values), 1),
                 "overhead_ns": round(median - base, 1)}
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2_000, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=101, help="samples per variant (the median is reported)")
    parser.add_argument("--clock", choices=sorted(_CLOCKS), default="thread", help="thread CPU time or wall time")
    parser.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    if args.iters < 10 or args.repeats < 1:
        raise SystemExit("--iters must be >= 10 and --repeats >= 1")
    rows = measure(args.iters, args.repeats, _CLOCKS[args.clock])
    print_table(
        f"dispatch overhead, ns per call ({args.clock} clock, median of {args.repeats} x {args.iters} calls)",
        ["mode", "variant", "median ns", "min ns", "overhead ns"],
        [[r["mode"], r["variant"], r["median_ns"], r["min_ns"], r["overhead_ns"]] for r in rows],
    )
    payload = {"benchmark": "dispatch", "clock": args.clock, "iters": args.iters, "repeats": args.repeats, "results": rows}
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
