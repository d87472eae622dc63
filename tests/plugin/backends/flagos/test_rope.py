"""flagos RoPE vs the reference backend: both layouts, interleaving, partial rotation, offsets."""

import pytest
import torch

from tests.plugin.backends.flagos._helpers import assert_close
from tests.utils import randn
from transformer_engine.plugin.backends.flagos import rope as fr
from transformer_engine.plugin.backends.reference import rope as ref


def _check(t, freqs, *args):
    assert_close(fr.fused_rope_forward(t, freqs, *args), ref.fused_rope_forward(t, freqs, *args))
    assert_close(fr.fused_rope_backward(t, freqs, *args), ref.fused_rope_backward(t, freqs, *args))


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
    _check(t, freqs, "sbhd", False, torch.tensor([0, 5], device=device))


def test_position_past_freqs_is_nan(device):
    out = fr.fused_rope_forward(randn(1, 2, 1, 4, device=device), randn(3, 1, 1, 4, device=device), "bshd", False,
                                torch.tensor([2], device=device))  # fmt: skip
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
    assert fr.SUPPORTS["fused_rope_backward"](t, freqs, "bshd", True)


@pytest.mark.gpu
def test_large_gpu():
    t = randn(2048, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    freqs = randn(4096, 1, 1, 128, device="cuda")
    _check(t, freqs, "sbhd", False)
    _check(t, freqs, "bshd", True, torch.randint(0, 4000, (2048,), device="cuda"))
