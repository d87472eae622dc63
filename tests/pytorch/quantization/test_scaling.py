"""The FP8 dtypes and maxima of each format (the current-scaling formula is the catalog's ``scale_from_amax``,
tested with the reference backend)."""

import pytest
import torch

from transformer_engine.common.recipe import Format
from transformer_engine.pytorch.quantization.scaling import fp8_dtypes, fp8_max


def test_fp8_dtypes_and_max():
    assert fp8_dtypes(Format.HYBRID) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_dtypes(Format.E4M3) == (torch.float8_e4m3fn, torch.float8_e4m3fn)
    assert (fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)) == (448.0, 57344.0)
    with pytest.raises(ValueError, match="E5M2"):
        fp8_dtypes(Format.E5M2)
