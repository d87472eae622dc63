"""Scaling formulas (current scaling) against a float64 oracle, and the FP8 dtypes of each format."""

import math

import pytest
import torch

from transformer_engine.common.recipe import Format, QParams
from transformer_engine.pytorch.quantization.scaling import FP32_MAX, amax_to_scale, fp8_dtypes, fp8_max


def _oracle(amax: float, fp8_max_value: float, eps: float, pow2: bool) -> float:
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    scale = fp8_max_value / max(amax, eps)
    if scale > FP32_MAX:
        scale = FP32_MAX
    if pow2:
        scale = 2.0 ** math.floor(math.log2(scale))
    return scale


@pytest.mark.parametrize("fp8_max_value", [448.0, 57344.0])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_amax_to_scale_matches_oracle(fp8_max_value, pow2, eps):
    amaxes = [3.7, 1e-3 * torch.rand(()).item() + 1e-6, 0.0, math.inf, math.nan, 1e-40, 5e4, 448.0]
    for amax in amaxes:
        got = amax_to_scale(torch.tensor(amax), fp8_max_value, QParams(power_2_scale=pow2, amax_epsilon=eps))
        want = torch.tensor(_oracle(amax, fp8_max_value, eps, pow2), dtype=torch.float32)
        assert got.dtype == torch.float32 and got.shape == ()
        assert torch.isfinite(got)
        torch.testing.assert_close(got, want, rtol=2e-7, atol=0, msg=f"amax={amax}")


def test_fp8_dtypes_and_max():
    assert fp8_dtypes(Format.HYBRID) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_dtypes(Format.E4M3) == (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert (fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)) == (448.0, 57344.0)
    with pytest.raises(ValueError, match="E5M2"):
        fp8_dtypes(Format.E5M2)
