"""benchmarks/bench_tp.py: the interval arithmetic behind its exposed-communication column."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_tp import _merged, _overlap  # noqa: E402


def test_merged_joins_overlapping_and_touching_spans():
    assert _merged([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]
    assert _merged([]) == []


def test_overlap_is_the_length_of_the_intersection():
    comm = _merged([(0, 3), (5, 7), (10, 12)])
    compute = _merged([(2, 6), (6, 11)])
    assert _overlap(comm, compute) == 1 + 2 + 1  # [2, 3), [5, 7), [10, 11)
    assert _overlap(comm, []) == 0
