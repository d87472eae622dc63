"""Helpers shared by the flagos kernel tests: tolerances, FP8 code comparison, awkward inputs, a
manager of the flagos and reference backends alone.

Tolerances: results are compared with the reference backend, which computes the same float32
formulas in another order (and, for bfloat16 outputs under the CPU interpreter, Triton's
interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest): one rounding apart
at most, so each dtype's row of ``tests.utils.DTYPE_TOLS`` (a few ulps) holds; float32 sums over
rows get 4x that row, as in the reference backend's own tests.
"""

from __future__ import annotations

import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin.backends import flagos, reference
from transformer_engine.plugin.core import OpManager, OpRegistry

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def tols(dtype: torch.dtype, reduction: bool = False) -> dict:
    """(rtol, atol) for a result in ``dtype``; ``reduction`` loosens float32 4x (summation order)."""
    tol = dtype_tols(dtype)
    if reduction and dtype == torch.float32:
        tol = {k: 4 * v for k, v in tol.items()}
    return tol


def assert_close(actual: torch.Tensor, expected: torch.Tensor, reduction: bool = False) -> None:
    """Same dtype, shape and values within the dtype's tolerance (compared in float64)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **tols(expected.dtype, reduction))


def wide_range(shape, dtype, device="cpu") -> torch.Tensor:
    """Random values from ~1e-6 to ~1e4 in magnitude: FP8 subnormals, normals and saturation."""
    magnitude = 10.0 ** (torch.rand(shape) * 10 - 6)
    return (randn(*shape) * magnitude).to(dtype).to(device)


def assert_outputs_identical(actual, expected) -> None:
    """Two tuples of op outputs with identical dtypes, shapes and bits (None where the other is None)."""
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"output {i}"
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape, f"output {i}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
            a_bits, e_bits = a.cpu().contiguous().view(torch.uint8), e.cpu().contiguous().view(torch.uint8)
            assert torch.equal(a_bits, e_bits), f"output {i}: {int((a_bits != e_bits).sum())} of {a_bits.numel()} bytes differ"


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values bit for bit (any dtype), any NaN matching any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = actual.cpu(), expected.cpu()
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(e))
    assert torch.equal(a[~nan].view(-1, 1).view(torch.uint8), e[~nan].view(-1, 1).view(torch.uint8))


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 codes as signed integers ordered like their values (sign-magnitude -> two's complement)."""
    codes = q.cpu().view(torch.uint8).long()
    magnitude = codes & 0x7F
    return torch.where(codes >= 0x80, -magnitude, magnitude)


def assert_fp8_equal(q: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical FP8 codes, except that any NaN code matches any NaN code."""
    assert q.dtype == expected.dtype and q.shape == expected.shape
    both_nan = torch.isnan(q.cpu().float()) & torch.isnan(expected.cpu().float())
    same = q.cpu().view(torch.uint8) == expected.cpu().view(torch.uint8)
    assert bool((same | both_nan).all()), f"{int((~(same | both_nan)).sum())} of {q.numel()} FP8 codes differ"


def assert_fp8_near(q: torch.Tensor, expected: torch.Tensor, max_fraction: float = 0.01) -> None:
    """FP8 codes at most one step apart, and at most ``max_fraction`` of them not identical.

    For fused ops whose float32 input to the cast may differ from the reference's by an ulp
    (another summation order), which moves the rounding of a value sitting on a tie or a grid
    boundary by one code.
    """
    assert q.dtype == expected.dtype and q.shape == expected.shape
    step = (_ordinal(q) - _ordinal(expected)).abs()
    if step.numel():
        assert int(step.max()) <= 1, f"FP8 codes differ by up to {int(step.max())} steps"
        assert float((step != 0).double().mean()) <= max_fraction, f"{int((step != 0).sum())} FP8 codes differ"


def flagos_and_reference(monkeypatch, device: str) -> OpManager:
    """A manager with only the flagos and reference backends (no builtins, no plugins); on "cpu" the
    flagos kernels run in Triton's interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if device == "cpu" else "0")
    registry = OpRegistry()
    flagos.register(registry)
    reference.register(registry)
    return OpManager(registry, load_builtins=False, discover=False)


# dbias: both sides sum in float32, each in its own order (flagos: tiles of 128 (or B) rows, then column_sums
# over the tiles; reference: torch's cascade sum). A blocked / tree float32 sum of n terms errs by about
# log2(n) * 2^-24 * sum_i |x[i, j]| at most (~1e-6 for n = 8192); 1e-5 also covers the short serial
# runs torch accumulates first. Dropped or doubled elements are caught exactly by the integer test.
DBIAS_RTOL = 1e-5


def assert_dbias_close(dbias, expected, x):
    """dbias within DBIAS_RTOL * sum_i |x[i, j]| of expected, NaN and +-inf in the same places."""
    assert dbias.dtype == torch.float32 and dbias.shape == expected.shape == (x.shape[1],)
    dbias, expected = dbias.cpu().double(), expected.cpu().double()
    finite = torch.isfinite(expected)
    torch.testing.assert_close(dbias[~finite], expected[~finite], rtol=0, atol=0, equal_nan=True)
    bound = DBIAS_RTOL * x.cpu().double().abs().sum(0)
    error = (dbias - expected).abs()[finite]
    assert bool((error <= bound[finite]).all()), f"max error {error.max()}"
