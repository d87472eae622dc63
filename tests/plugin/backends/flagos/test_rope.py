"""flagos RoPE vs the reference backend: both layouts, interleaving, partial rotation, offsets."""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import assert_close
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import rope as fr
from transformer_engine.plugin.backends.reference import rope as ref


def _check(t, freqs, *args, **kwargs):
    assert_close(fr.fused_rope_forward(t, freqs, *args, **kwargs), ref.fused_rope_forward(t, freqs, *args, **kwargs))
    assert_close(fr.fused_rope_backward(t, freqs, *args, **kwargs), ref.fused_rope_backward(t, freqs, *args, **kwargs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
def test_rope(tensor_format, interleaved, dtype, device):
    s, b, h, d, d_rot = 3, 2, 5, 12, 8  # odd heads, partial rotation (the last 4 features pass)
    shape = (s, b, h, d) if tensor_format == "sbhd" else (b, s, h, d)
    freqs = randn(7, 1, 1, d_rot, device=device)  # arbitrary angles: not duplicated over pairs
    _check(randn(*shape, dtype=dtype, device=device), freqs, tensor_format, interleaved)


def test_rope_start_positions_and_strided_input(device):
    t = randn(2, 3, 4, 16, device=device).transpose(0, 1)  # sbhd view of a bshd tensor
    freqs = randn(9, 1, 1, 16, device=device)
    _check(t, freqs, "sbhd", interleaved=False, start_positions=torch.tensor([0, 5], device=device))


def test_position_past_freqs_is_nan(device):
    out = fr.fused_rope_forward(randn(1, 2, 1, 4, device=device), randn(3, 1, 1, 4, device=device), "bshd", interleaved=False,
                                start_positions=torch.tensor([2], device=device))  # fmt: skip
    assert bool(torch.isnan(out.cpu()[0, 1]).all()) and not bool(torch.isnan(out.cpu()[0, 0]).any())


def test_errors_and_supports(device):
    t, freqs = randn(3, 2, 4, 8, device=device), randn(3, 1, 1, 8, device=device)
    with pytest.raises(ValueError, match="freqs"):
        fr.fused_rope_forward(t, randn(3, 1, 1, 10, device=device))
    with pytest.raises(ValueError, match="past"):
        fr.fused_rope_forward(t, randn(2, 1, 1, 8, device=device))
    for kwargs in (dict(tensor_format="thd"), dict(cp_size=2, cp_rank=1)):
        verdict = fr.SUPPORTS["fused_rope_forward"](t, freqs, **kwargs)
        assert not verdict and verdict.reason
    assert fr.SUPPORTS["fused_rope_backward"](t, freqs, "bshd", interleaved=True)


@pytest.mark.parametrize("backward", [False, True])
def test_thd_input_is_checked_as_the_reference_checks_it(backward, device):
    """thd is [t, h, d] (3-D) with cu_seqlens, as the catalog and the reference take it: a valid one runs on the
    reference and is declined by this kernel (SUPPORTS; NotImplementedError when called directly), not told to be
    4-D; a 4-D "thd" tensor, or one without cu_seqlens, gets the reference's ValueError from both."""
    fr_op, ref_op = (fr.fused_rope_backward, ref.fused_rope_backward) if backward else (fr.fused_rope_forward, ref.fused_rope_forward)
    t, freqs = randn(5, 2, 8, device=device), randn(5, 1, 1, 8, device=device)
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    assert ref_op(t, freqs, "thd", cu_seqlens=cu_seqlens).shape == t.shape
    assert not fr.SUPPORTS[fr_op.__name__](t, freqs, "thd", cu_seqlens=cu_seqlens)
    with pytest.raises(NotImplementedError, match="thd"):
        fr_op(t, freqs, "thd", cu_seqlens=cu_seqlens)
    for args, kwargs, match in (((t[:, None], freqs, "thd"), dict(cu_seqlens=cu_seqlens), "needs a 3-D tensor"),
                                ((t, freqs, "thd"), {}, "needs cu_seqlens")):  # fmt: skip
        errors = []
        for op in (ref_op, fr_op):
            with pytest.raises(ValueError, match=match) as info:
                op(*args, **kwargs)
            errors.append(str(info.value))
        assert errors[0] == errors[1]


def test_context_parallel_is_declined_on_a_direct_call(device):
    t, freqs = randn(4, 2, 3, 8, device=device), randn(8, 1, 1, 8, device=device)
    with pytest.raises(NotImplementedError, match="cp_size=2"):
        fr.fused_rope_forward(t, freqs, "sbhd", cp_size=2, cp_rank=1)


@pytest.mark.gpu
def test_large_gpu():
    t = randn(2048, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    freqs = randn(4096, 1, 1, 128, device="cuda")
    _check(t, freqs, "sbhd", interleaved=False)
    _check(t, freqs, "bshd", interleaved=True, start_positions=torch.randint(0, 4000, (2048,), device="cuda"))
