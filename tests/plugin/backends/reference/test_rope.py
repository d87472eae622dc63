"""Reference RoPE vs a float64 formula (positions written out token by token), backward vs autograd."""

import pytest
import torch

from tests.utils import dtype_tols, randn
from transformer_engine.plugin import ops
from transformer_engine.plugin.backends.reference.rope import fused_rope_backward, fused_rope_forward


def _partner(d_rot, interleaved):
    """(index, sign) with R(x)_i = sign_i x_index_i: pairs (2i, 2i+1) or halves (i, i + d/2)."""
    i = torch.arange(d_rot)
    if interleaved:
        return i ^ 1, torch.where(i % 2 == 0, -1.0, 1.0).double()
    return (i + d_rot // 2) % d_rot, torch.where(i < d_rot // 2, -1.0, 1.0).double()


def _oracle(x, freqs, positions, interleaved):
    """float64 rope of x [..., h, d] whose token dims carry ``positions`` (int tensor of x.shape[:-2])."""
    d_rot = freqs.shape[-1]
    angles = freqs.reshape(freqs.shape[0], d_rot).double()[positions].unsqueeze(-2)
    index, sign = _partner(d_rot, interleaved)
    xr = x[..., :d_rot].double()
    out = xr * torch.cos(angles) + sign * xr[..., index] * torch.sin(angles)
    return torch.cat((out, x[..., d_rot:].double()), dim=-1)


def _positions(tensor_format, s, b, start_positions):
    pos = torch.tensor([[si + (int(start_positions[bi]) if start_positions is not None else 0) for bi in range(b)] for si in range(s)])
    return pos if tensor_format == "sbhd" else pos.T


def _layout(tensor_format, s, b, h, d, dtype=torch.float32):
    return randn(s, b, h, d, dtype=dtype) if tensor_format == "sbhd" else randn(b, s, h, d, dtype=dtype)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("d_rot", [10, 6])
@pytest.mark.parametrize("with_start", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_float64_formula(tensor_format, interleaved, d_rot, with_start, dtype):
    s, b, h, d = 7, 3, 2, 10
    start = torch.tensor([0, 4, 1]) if with_start else None
    freqs = randn(s + 5, 1, 1, d_rot, scale=3.0)
    x = _layout(tensor_format, s, b, h, d, dtype)
    out = fused_rope_forward(x, freqs, tensor_format, interleaved, start_positions=start)
    ref = _oracle(x, freqs, _positions(tensor_format, s, b, start), interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref, **dtype_tols(dtype))
    assert torch.equal(out[..., d_rot:], x[..., d_rot:])


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_matches_autograd(tensor_format, interleaved):
    s, b, h, d, d_rot = 5, 2, 3, 8, 6
    freqs = randn(s, 1, 1, d_rot, scale=3.0)  # halves differ: checks the exact transpose, not just s -> -s
    x = _layout(tensor_format, s, b, h, d).double().requires_grad_()
    ref = _oracle(x, freqs, _positions(tensor_format, s, b, None), interleaved)
    grad_out = randn(*x.shape)
    ref.backward(grad_out.double())
    got = fused_rope_backward(grad_out, freqs, tensor_format, interleaved)
    torch.testing.assert_close(got.double(), x.grad, **dtype_tols(torch.float32))


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_inverts_forward_for_te_freqs(interleaved):
    d_rot = 8
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d_rot, 2).float() / d_rot)
    angles = torch.outer(torch.arange(11).float(), inv_freq)
    freqs = (angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1))[:, None, None]
    x = randn(11, 2, 3, 12)
    back = fused_rope_backward(fused_rope_forward(x, freqs, "sbhd", interleaved), freqs, "sbhd", interleaved)
    torch.testing.assert_close(back, x, **dtype_tols(torch.float32))


def test_thd_positions_restart_per_sequence():
    lens, h, d, d_rot = [3, 1, 5], 2, 8, 8
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    start = torch.tensor([2, 0, 5])
    freqs = randn(12, 1, 1, d_rot)
    x = randn(11, h, d)  # two padding rows after the last sequence pass through
    positions = torch.tensor([p + int(start[i]) for i, n in enumerate(lens) for p in range(n)] + [0, 0])
    out = fused_rope_forward(x, freqs, "thd", interleaved=True, start_positions=start, cu_seqlens=cu_seqlens)
    ref = _oracle(x, freqs, positions, interleaved=True)
    torch.testing.assert_close(out[:9].double(), ref[:9], **dtype_tols(torch.float32))
    assert torch.equal(out[9:], x[9:])
    xg = x.double().requires_grad_()
    grad_out = randn(11, h, d)
    _oracle(xg, freqs, positions, interleaved=True)[:9].backward(grad_out[:9].double())
    got = fused_rope_backward(grad_out, freqs, "thd", interleaved=True, start_positions=start, cu_seqlens=cu_seqlens)
    torch.testing.assert_close(got[:9].double(), xg.grad[:9], **dtype_tols(torch.float32))
    assert torch.equal(got[9:], grad_out[9:])


def _cp_chunks(seq, cp_size, rank):
    chunks = seq.chunk(2 * cp_size, dim=0)
    return torch.cat((chunks[rank], chunks[2 * cp_size - 1 - rank]), dim=0)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_context_parallel_rank_holds_its_chunks(cp_size):
    s, d = 12 * cp_size // 2, 8
    freqs = randn(s, 1, 1, d)
    full = randn(s, 2, 2, d)
    ref = fused_rope_forward(full, freqs, "sbhd")
    lens = [4 * cp_size, 2 * cp_size]  # global (padded) lengths, divisible by 2 cp_size
    cu_global = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
    seqs = [randn(n, 2, d) for n in lens]
    refs = [fused_rope_forward(t[:, None], freqs, "sbhd")[:, 0] for t in seqs]
    for rank in range(cp_size):
        local = fused_rope_forward(_cp_chunks(full, cp_size, rank), freqs, "sbhd", cp_size=cp_size, cp_rank=rank)
        torch.testing.assert_close(local, _cp_chunks(ref, cp_size, rank), rtol=0, atol=0)
        packed = torch.cat([_cp_chunks(t, cp_size, rank) for t in seqs])
        out = fused_rope_forward(packed, freqs, "thd", cu_seqlens=cu_global, cp_size=cp_size, cp_rank=rank)
        torch.testing.assert_close(out, torch.cat([_cp_chunks(r, cp_size, rank) for r in refs]), rtol=0, atol=0)


def test_dispatch_through_ops_runs_reference():
    x, freqs = randn(5, 2, 3, 8), randn(5, 1, 1, 8)
    out, impl = ops.fused_rope_forward.traced(x, freqs, "sbhd", interleaved=False)
    assert impl.impl_id == "reference.torch"
    torch.testing.assert_close(out, fused_rope_forward(x, freqs), rtol=0, atol=0)
    torch.testing.assert_close(ops.fused_rope_backward(x, freqs), fused_rope_backward(x, freqs), rtol=0, atol=0)


def test_invalid_inputs_raise():
    x = randn(5, 2, 3, 8)
    with pytest.raises(ValueError, match="past the 4 rows of freqs"):
        fused_rope_forward(x, randn(4, 1, 1, 8))
    with pytest.raises(ValueError, match="even d_rot"):
        fused_rope_forward(x, randn(5, 1, 1, 10))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_rope_forward(x[0], randn(5, 1, 1, 8), "thd")
    with pytest.raises(ValueError, match="start_positions"):
        fused_rope_forward(x, randn(5, 1, 1, 8), start_positions=torch.zeros(2), cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="even"):
        fused_rope_forward(x, randn(20, 1, 1, 8), cp_size=2)
