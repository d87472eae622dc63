"""RotaryPositionEmbedding and apply_rotary_pos_emb vs the float64 rotation written pair by pair."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.attention._reference import rope_angles as _table
from tests.pytorch.attention._reference import rotate as _rotate
from tests.utils import dtype_tols, randn
from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

FP32 = dtype_tols(torch.float32)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dim,percent", [(16, 1.0), (16, 0.5), (12, 1.0)])
def test_frequency_table(dim, percent, interleaved):
    rope = te.RotaryPositionEmbedding(dim, rotary_percent=percent, rotary_base=500.0, interleaved=interleaved)
    freqs = rope(7, offset=3)
    d_rot = int(dim * percent)
    assert freqs.shape == (7, 1, 1, d_rot) and freqs.dtype == torch.float32
    theta = _table(torch.arange(3, 10), d_rot, base=500.0)
    want = theta.repeat_interleave(2, dim=1) if interleaved else torch.cat([theta, theta], dim=1)
    torch.testing.assert_close(freqs.reshape(7, d_rot).double(), want, **FP32)


@pytest.mark.parametrize("length,scale", [(6, 1 / 2), (10, 4 / 10)])
def test_sequence_length_interpolation(length, scale):
    """pretrained 4 x factor 2: positions / 2 up to length 8, then positions * pretrained / length."""
    rope = te.RotaryPositionEmbedding(8, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=4)
    theta = _table(torch.arange(length) * scale, 8)
    torch.testing.assert_close(rope(length).reshape(length, 8).double(), torch.cat([theta, theta], 1), **FP32)
    plain = te.RotaryPositionEmbedding(8, seq_len_interpolation_factor=2)  # TE: ignored without pretrained
    torch.testing.assert_close(plain(length), te.RotaryPositionEmbedding(8)(length), rtol=0, atol=0)


def _positions(fmt, s, b, start):
    pos = torch.arange(s)[:, None] + (start[None, :] if start is not None else torch.zeros(1, b, dtype=torch.long))
    return pos if fmt == "sbhd" else pos.T


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("with_start", [False, True])
def test_apply_sbhd_bshd(fmt, interleaved, fused, with_start):
    s, b, h, d, d_rot = 7, 3, 2, 12, 8
    freqs = te.RotaryPositionEmbedding(d_rot, interleaved=interleaved)(16)
    x = randn(*((s, b, h, d) if fmt == "sbhd" else (b, s, h, d))).requires_grad_(requires_grad=True)
    start = torch.tensor([0, 4, 9]) if with_start else None
    out = apply_rotary_pos_emb(x, freqs, fmt, start_positions=start, interleaved=interleaved, fused=fused)
    ref = _rotate(x, _positions(fmt, s, b, start), d_rot, interleaved)
    torch.testing.assert_close(out.double(), ref, **FP32)
    cot = randn(*x.shape)
    (got,) = torch.autograd.grad(out, x, cot)
    (want,) = torch.autograd.grad(ref, x, cot.double())
    torch.testing.assert_close(got.double(), want.double(), **FP32)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_apply_thd_restarts_positions_per_sequence(fused, with_start):
    lens, h, d = [3, 1, 5], 2, 8
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    start = torch.tensor([2, 0, 6]) if with_start else None
    x = randn(9, h, d).requires_grad_(requires_grad=True)
    freqs = te.RotaryPositionEmbedding(d)(16)
    out = apply_rotary_pos_emb(x, freqs, "thd", start_positions=start, fused=fused, cu_seqlens=cu)
    pos = torch.cat([torch.arange(n) + (0 if start is None else int(start[i])) for i, n in enumerate(lens)])
    ref = _rotate(x, pos, d, interleaved=False)
    torch.testing.assert_close(out.double(), ref, **FP32)
    (got,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(got.double(), want.double(), **FP32)


def test_fused_and_unfused_agree_in_bf16():
    freqs = te.RotaryPositionEmbedding(16)(10)
    x = randn(10, 2, 3, 16, dtype=torch.bfloat16)
    fused = apply_rotary_pos_emb(x, freqs, fused=True)
    unfused = apply_rotary_pos_emb(x, freqs, fused=False)
    assert fused.dtype == unfused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 * dtype_tols(torch.bfloat16)["rtol"], atol=2e-2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tensor_format="thd"), "cu_seqlens"),
        (dict(tensor_format="bhsd"), "tensor_format"),
        (dict(start_positions=torch.tensor([0]), cp_size=2), "start_positions"),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_rotary_pos_emb(randn(4, 1, 2, 8), te.RotaryPositionEmbedding(8)(4), **kwargs)


def test_too_short_table():
    with pytest.raises(ValueError, match="past the 4 rows"):
        apply_rotary_pos_emb(randn(6, 1, 2, 8), te.RotaryPositionEmbedding(8)(4))
