"""flagos ``column_sums`` (the second pass of the norm backward's dgamma / dbeta and of cast_transpose_dbias)
against float64 sums."""

import pytest
import torch

from tests.utils import randn
from transformer_engine.plugin.backends.flagos._column_sums import column_sums


# (0, 5): no partial rows (sums are 0); (1, 1), (1, 40): one row (float32: the row itself, no launch);
# (130, 33): P over two 64-row steps with a short last one, H not a multiple of the 32-column block;
# (64, 32): exact blocks
@pytest.mark.parametrize("rows, cols", [(0, 5), (1, 1), (1, 40), (130, 33), (64, 32)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two", [False, True], ids=["one", "two"])
def test_column_sums_match_float64(rows, cols, out_dtype, two, device):
    a = randn(rows, cols, device=device, scale=3.0)
    b = randn(rows, cols, device=device) if two else None
    out_a, out_b = column_sums(a, out_dtype, b)
    assert out_a.dtype == out_dtype and out_a.shape == (cols,)
    # float32 sums of at most 130 terms: within 1e-5 of sum |a|; in bfloat16 one ulp (2^-7 relative:
    # the interpreter's float casts truncate, the GPU's round to nearest)
    rtol = 1e-5 if out_dtype == torch.float32 else 2**-7
    for out, parts in ((out_a, a), (out_b, b)):
        if parts is None:
            assert out is None
            continue
        expected = parts.double().sum(dim=0)
        bound = rtol * parts.double().abs().sum(dim=0) + 1e-30
        assert torch.all((out.double() - expected).abs() <= bound), (out, expected)
