"""vendor.cuda grouped GEMMs against the reference backend's (the per-split float32 GEMMs).

On CPU: what the SUPPORTS predicates decline. On a GPU: the one-launch path (``torch._scaled_grouped_mm``: E4M3,
bfloat16 out, no bias) and the per-split cuBLASLt path (E5M2 operands, a bias, empty splits), each against the
reference on the same values, and against the per-split vendor ``gemm`` bit for bit where both are cuBLASLt.
Tolerances as in test_gemm.py: Hopper's FP8 MMA accumulates about 14 bits before partial sums are promoted
(``_fp8_tols``: 2^-9 of the largest output, plus bf16's rtol); fast accumulation (the fprop's
``use_split_accumulator=False``) keeps fewer bits: there an SQNR floor of 40 dB.
"""

from __future__ import annotations

import pytest
import torch

from tests.plugin.backends.vendor.cuda.test_gemm import _fp8_tols
from tests.utils import randn, sqnr
from transformer_engine.plugin.backends.reference import grouped as reference
from transformer_engine.plugin.backends.vendor.cuda import gemm as vendor_gemm
from transformer_engine.plugin.backends.vendor.cuda import gemm_grouped as vendor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPLITS = (48, 16, 64, 32)


def test_declines_off_cuda_and_misaligned_wgrad_splits():
    a, b = torch.zeros(8, 16), torch.zeros(2, 16, 16)
    assert "CUDA" in vendor._supports_gemm_grouped(a, b, (4, 4)).reason
    assert "CUDA" in vendor._supports_gemm_grouped_wgrad(torch.zeros(16, 8), torch.zeros(16, 8), (4, 4)).reason


def _fp8(*shape, dtype, device="cuda"):
    return (randn(*shape, device=device) * 2).to(dtype)


def _scales(groups, device="cuda"):
    return torch.rand(groups, device=device) + 0.25


def _close(got, want, fast_accum=False):
    assert got.dtype == want.dtype and got.shape == want.shape
    if fast_accum:
        assert sqnr(want.float(), got.float()) > 40
    else:
        torch.testing.assert_close(got, want, **_fp8_tols(want.dtype, want))


@pytest.mark.gpu
@pytest.mark.parametrize("split_accumulator", [True, False])
def test_one_launch_fprop_matches_reference(split_accumulator):
    """E4M3 x E4M3 into bf16 without bias, every split non-empty: torch._scaled_grouped_mm."""
    groups, n, k = len(SPLITS), 96, 128
    a, b = _fp8(sum(SPLITS), k, dtype=E4M3), _fp8(groups, n, k, dtype=E4M3)
    sa, sb = _scales(groups), _scales(groups)
    assert vendor._one_launch(a, b, SPLITS, torch.bfloat16)
    got = vendor.gemm_grouped(a, b, SPLITS, sa, sb, torch.bfloat16, use_split_accumulator=split_accumulator)
    _close(got, reference.gemm_grouped(a, b, SPLITS, sa, sb, torch.bfloat16), fast_accum=not split_accumulator)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_per_split_path_with_e5m2_strided_weights_and_empty_splits(bias):
    """dgrad's operands: E5M2 dy and W^T as [G, K, N] views of one [K, G N] transpose; a bias; an empty split."""
    splits, groups, n, k = (32, 0, 48, 16), 4, 64, 80
    a = _fp8(sum(splits), k, dtype=E5M2)
    b_t = _fp8(k, groups * n, dtype=E4M3)
    b = b_t.view(k, groups, n).permute(1, 2, 0)  # [G, N, K] with unit stride along N
    sa, sb = _scales(groups), _scales(groups)
    bias_t = randn(groups, n, dtype=torch.bfloat16, device="cuda") if bias else None
    assert not vendor._one_launch(a, b, splits, torch.bfloat16, bias_t)
    got = vendor.gemm_grouped(a, b, splits, sa, sb, torch.bfloat16, bias=bias_t)
    _close(got, reference.gemm_grouped(a, b, splits, sa, sb, torch.bfloat16, bias=bias_t))
    per_split = [vendor_gemm.gemm(a[start:start + m], b[g], bias=None if bias_t is None else bias_t[g], a_scale_inv=sa[g:g + 1].clone(),
                                  b_scale_inv=sb[g:g + 1].clone(), trans_b=True, out_dtype=torch.bfloat16)
                 for g, (start, m) in enumerate(zip((0, 32, 32, 80), splits)) if m]
    assert torch.equal(got, torch.cat(per_split))


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
def test_wgrad_matches_reference(dtypes):
    """One launch for E4M3 operands, per split for E5M2 dy; an empty split gives zeros."""
    splits = SPLITS if dtypes[0] == E4M3 else (48, 0, 64, 48)
    groups, n, k = len(splits), 64, 96
    a_t, b_t = _fp8(n, sum(splits), dtype=dtypes[0]), _fp8(k, sum(splits), dtype=dtypes[1])
    sa, sb = _scales(groups), _scales(groups)
    assert vendor._one_launch(a_t, b_t, splits, torch.bfloat16) == (dtypes[0] == E4M3)
    got = vendor.gemm_grouped_wgrad(a_t, b_t, splits, sa, sb, torch.bfloat16)
    _close(got, reference.gemm_grouped_wgrad(a_t, b_t, splits, sa, sb, torch.bfloat16))
    if 0 in splits:
        assert not got[splits.index(0)].any()


@pytest.mark.gpu
def test_wgrad_declines_misaligned_splits():
    a_t, b_t = _fp8(32, 40, dtype=E4M3), _fp8(32, 40, dtype=E4M3)
    verdict = vendor._supports_gemm_grouped_wgrad(a_t, b_t, (24, 16), _scales(2), _scales(2), torch.bfloat16)
    assert not verdict and "multiple of 16" in verdict.reason
