"""benchmarks/bench_optimizers.py: the bytes per parameter it reports, counted on small layers on the CPU."""

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_optimizers import _measure, _shapes, _variants  # noqa: E402


def test_bytes_per_parameter_of_every_variant():
    shapes = _shapes(1, hidden=64)  # one layer: 12 * 64^2 + 2 * 64 elements
    count = sum(s[0] * (s[1] if len(s) == 2 else 1) for s in shapes)
    matrices = count - 2 * 64
    measured = {(setting, name): _measure(*build(), timed=False)[1:]
                for setting, variants in _variants(shapes, "cpu").items() for name, build in variants.items()}
    assert measured[("fp32", "te FusedAdam")] == (4 * count, 8 * count)
    assert measured[("bf16 + fp32 master", "te FusedAdam(master_weights)")] == (2 * count, 12 * count)
    params, state = measured[("FP8 + fp32 master", "te FusedAdam(master_weights)")]
    # FP8 matrices: one byte each and a float32 scale_inv per matrix (6 of them); the two norm vectors bf16
    assert params == matrices + 6 * 4 + 2 * 2 * 64 and state == 12 * count
