"""flagos dropout / bias-dropout-add against their formulas with the returned mask (Philox keep
statistics, seeding, edge probabilities), and cross entropy vs the reference backend."""

import math

import pytest
import torch

from tests.plugin.backends.flagos._helpers import HP_DTYPES, assert_close, assert_dbias_close, flagos_and_reference
from tests.utils import randn
from transformer_engine.plugin.backends import flagos, reference
from transformer_engine.plugin.backends._dropout_mask import pack_keep, packed_bytes, unpack_keep
from transformer_engine.plugin.backends.flagos import misc as fm
from transformer_engine.plugin.backends.reference import misc as ref

# -- dropout and bias-dropout-add ---------------------------------------------------------------
# Each kept value is one float32 multiply (and adds) rounded once to the output dtype, so it matches
# the float64 formula within the dtype's row of DTYPE_TOLS; scale = 2 (p = 0.5) is exact in every
# dtype, so there y must equal x * m * 2 bit for bit (the interpreter's bf16 truncation included).


def _keep_bound(p: float, n: int) -> float:
    """6 sigma of the kept fraction of n Bernoulli(1 - p) draws."""
    return 6 * math.sqrt(p * (1 - p) / n)


def _keep(mask, shape):
    """The bool keep mask (on the CPU) of a packed mask."""
    return unpack_keep(mask.cpu(), shape)


def _rng_state(device):
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def _set_rng_state(device, state) -> None:
    if device == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1001), (5003,)])  # 5003: several programs, a partial last quarter
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_matches_formula_with_its_mask(shape, dtype, p, device):
    x = randn(*shape, dtype=dtype, device=device)
    y, mask = fm.dropout_fwd(x, p)
    assert mask.dtype == torch.uint8 and mask.shape == (packed_bytes(x.numel()),) and y.dtype == dtype and y.shape == x.shape
    keep = unpack_keep(mask, x.shape)
    assert torch.equal(mask, pack_keep(keep)), "the bits past numel are 0"
    assert not bool(y[~keep].any()), "dropped elements must be exactly 0"
    assert_close(y, (x.double() * keep / (1 - p)).to(dtype))
    dy = randn(*shape, dtype=dtype, device=device)
    dx = fm.dropout_bwd(dy, mask, p)
    assert_close(dx, (dy.double() * keep / (1 - p)).to(dtype))
    if p == 0.5:
        assert torch.equal(y, x * keep * 2) and torch.equal(dx, dy * keep * 2)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.83])
def test_keep_fraction_and_distinct_quarters(p, device):
    n = 5000
    keep = _keep(fm.dropout_fwd(randn(n, device=device), p)[1], (n,))
    assert abs(keep.double().mean().item() - (1 - p)) < _keep_bound(p, n)
    for start in (0, fm._QUARTER, 2 * fm._QUARTER):  # each quarter uses another Philox output
        part = keep[start:start + fm._QUARTER]
        assert abs(part.double().mean().item() - (1 - p)) < _keep_bound(p, part.numel())
    assert not torch.equal(keep[: fm._QUARTER], keep[fm._QUARTER : 2 * fm._QUARTER])


def test_many_programs_draw_distinct_masks(monkeypatch, device):
    monkeypatch.setattr(fm, "_QUARTER", 64)  # 4000 elements -> 16 programs of 4 quarters
    keep = _keep(fm.dropout_fwd(randn(4000, device=device), 0.5)[1], (4000,))
    chunks = keep[: 62 * 64].view(62, 64)  # the last 32 elements make a partial chunk
    assert len({tuple(c.tolist()) for c in chunks}) == 62, "two chunks drew the same numbers"
    assert abs(keep.double().mean().item() - 0.5) < _keep_bound(0.5, 4000)


def test_seeding_replay_and_fresh_masks(device):
    x = randn(999, device=device)
    torch.manual_seed(11)
    first = fm.dropout_fwd(x, 0.5)[1]
    second = fm.dropout_fwd(x, 0.5)[1]
    assert not torch.equal(first, second), "consecutive calls must draw new masks"
    torch.manual_seed(11)
    assert torch.equal(fm.dropout_fwd(x, 0.5)[1], first)
    state = _rng_state(device)  # te.checkpoint's replay: restore the state, draw the same mask
    keep = fm.bias_dropout_add_fwd(x, None, x, 0.3)[1]
    _set_rng_state(device, state)
    assert torch.equal(fm.bias_dropout_add_fwd(x, None, x, 0.3)[1], keep)


def test_edge_probabilities_and_layouts(device):
    x = randn(37, 29, device=device)
    x[0, 0] = float("inf")
    y, mask = fm.dropout_fwd(x, 0.0)
    assert bool(_keep(mask, x.shape).all()) and torch.equal(y, x)
    y, mask = fm.dropout_fwd(x, 1.0)
    assert not bool(mask.any()) and not bool(y.any())
    assert not bool(fm.dropout_bwd(x, mask, 1.0).any())
    y, mask = fm.dropout_fwd(x.t(), 0.5)  # non-contiguous: copied first
    keep = unpack_keep(mask, (29, 37))
    assert y.shape == (29, 37) and torch.equal(y, x.t() * keep * 2)
    assert torch.equal(fm.dropout_bwd(x.t(), mask, 0.5), x.t() * keep * 2)
    y, mask = fm.dropout_fwd(randn(0, 5, device=device), 0.5)
    assert y.shape == (0, 5) and mask.shape == (0,)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 1), (3, 7), (13, 331)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_add_matches_float64_formula(rows, hidden, dtype, with_bias, device):
    x, residual = randn(rows, hidden, dtype=dtype, device=device), randn(rows, hidden, dtype=dtype, device=device)
    bias = randn(hidden, dtype=dtype, device=device) if with_bias else None
    out, mask = fm.bias_dropout_add_fwd(x, bias, residual, 0.3)
    assert mask.dtype == torch.uint8 and mask.shape == (packed_bytes(x.numel()),) and out.dtype == dtype
    keep = unpack_keep(mask, x.shape)
    h = x.double() + (0 if bias is None else bias.double())
    assert_close(out, (residual.double() + h * keep / 0.7).to(dtype))


def test_bias_dropout_add_mixed_dtypes_and_batched_rows(device):
    x = randn(2, 3, 5003, dtype=torch.bfloat16, device=device)  # bias index wraps mid-quarter
    bias, residual = randn(5003, device=device), randn(2, 3, 5003, dtype=torch.float16, device=device)
    out, mask = fm.bias_dropout_add_fwd(x, bias, residual, 0.5)
    keep = unpack_keep(mask, x.shape)
    assert out.dtype == torch.bfloat16
    assert_close(out, (residual.double() + (x.double() + bias.double()) * keep * 2).to(torch.bfloat16))


@pytest.mark.parametrize("hidden", [128, 192])  # a multiple of the quarter (no modulo for the bias column), and not
def test_bias_dropout_add_row_aligned_quarters(monkeypatch, hidden, device):
    monkeypatch.setattr(fm, "_QUARTER", 64)
    x, residual = randn(5, hidden, device=device), randn(5, hidden, device=device)
    bias = randn(hidden, device=device)
    out, mask = fm.bias_dropout_add_fwd(x, bias, residual, 0.5)
    keep = unpack_keep(mask, x.shape)
    assert torch.equal(out, residual + (x + bias) * keep * 2)


def _check_dropout_bwd_dbias(dy, p, device):
    """dx bit-identical to dropout_bwd's, dbias within the float32 bound of the float64 column sums (and the reference's)."""
    keep = (torch.rand(dy.shape) >= p).to(device)
    mask = pack_keep(keep)
    dx, dbias = fm.dropout_bwd_dbias(dy, mask, p)
    assert torch.equal(dx, fm.dropout_bwd(dy, mask, p))
    products = (dy.double() * keep / (1 - p)).reshape(-1, dy.shape[-1])
    assert_dbias_close(dbias, products.sum(0), products)
    ref_dx, ref_dbias = ref.dropout_bwd_dbias(dy, mask, p)
    assert_close(dx, ref_dx)
    assert_dbias_close(dbias, ref_dbias, products)


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(8,), (3, 1000), (300, 72), (2, 129, 264)])  # rows past one 128-row chunk
def test_dropout_bwd_dbias_matches_dropout_bwd_and_the_column_sums(shape, dtype, device):
    _check_dropout_bwd_dbias(randn(*shape, dtype=dtype, device=device), 0.3, device)


def test_dropout_bwd_dbias_declines_rows_not_byte_aligned(monkeypatch, device):
    dy = randn(13, 67, device=device)
    mask = pack_keep(torch.ones(13, 67, dtype=torch.bool, device=device))
    verdict = fm.SUPPORTS["dropout_bwd_dbias"](dy, mask, 0.5)
    assert not verdict and "multiple of 8" in verdict.reason
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        fm.dropout_bwd_dbias(dy, mask, 0.5)
    (dx, dbias), impl = flagos_and_reference(monkeypatch, device).dispatcher("dropout_bwd_dbias").traced(dy, mask, 0.5)
    assert impl.impl_id == reference.IMPL_ID and torch.equal(dx, dy * 2)


def test_dropout_bwd_dbias_sums_integers_exactly_and_edges(monkeypatch, device):
    # small integers times 2 (p = 0.5) sum exactly in any order: every element counted once, masked lanes 0;
    # several chunks and column tiles, a ragged last of each
    monkeypatch.setattr(fm, "_DBIAS_ROWS", 32)
    monkeypatch.setattr(fm, "_DBIAS_BYTES", 4)
    dy = torch.randint(-8, 9, (100, 72)).to(torch.bfloat16).to(device)
    keep = (torch.rand(dy.shape) >= 0.5).to(device)
    dx, dbias = fm.dropout_bwd_dbias(dy, pack_keep(keep), 0.5)
    assert torch.equal(dx, dy * keep * 2) and torch.equal(dbias.cpu(), (dy.cpu().double() * keep.cpu() * 2).sum(0).float())
    dx, dbias = fm.dropout_bwd_dbias(dy, pack_keep(keep), 1.0)  # p = 1 keeps nothing
    assert not bool(dx.any()) and not bool(dbias.any())
    dx, dbias = fm.dropout_bwd_dbias(randn(0, 8, device=device), pack_keep(torch.zeros(0, 8, dtype=torch.bool, device=device)), 0.5)
    assert dx.shape == (0, 8) and dbias.dtype == torch.float32 and dbias.cpu().tolist() == [0.0] * 8
    with pytest.raises(ValueError, match="last dim"):
        fm.dropout_bwd_dbias(randn(1, device=device)[0], pack_keep(torch.ones(1, dtype=torch.bool, device=device)), 0.5)
    with pytest.raises(ValueError, match="3 bytes"):
        fm.dropout_bwd_dbias(randn(4, 6, device=device), pack_keep(torch.ones(4, 6, dtype=torch.bool, device=device))[:2], 0.5)


def test_dropout_errors_and_supports(device):
    x = randn(4, 6, device=device)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"p=.* must be in \[0, 1\]"):
            fm.dropout_fwd(x, bad)
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            fm.dropout_bwd(x, pack_keep(x > 0), bad)
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            fm.bias_dropout_add_fwd(x, None, x, bad)
    with pytest.raises(ValueError, match="3 bytes"):
        fm.dropout_bwd(x, pack_keep(x > 0)[:2], 0.5)
    with pytest.raises(TypeError, match="uint8"):
        fm.dropout_bwd(x, x > 0, 0.5)  # the unpacked bool mask
    with pytest.raises(ValueError, match=r"bias must be \[6\]"):
        fm.bias_dropout_add_fwd(x, randn(5, device=device), x, 0.5)
    with pytest.raises(ValueError, match="residual"):
        fm.bias_dropout_add_fwd(x, None, x[:3], 0.5)
    verdict = fm.SUPPORTS["dropout_fwd"](x.double(), 0.5)
    assert not verdict and "float64" in verdict.reason
    verdict = fm.SUPPORTS["bias_dropout_add_fwd"](x, None, x.double(), 0.5)
    assert not verdict and "float64" in verdict.reason
    assert fm.SUPPORTS["bias_dropout_add_fwd"](x, randn(6, device=device), x, 0.5)
    if device == "cuda":
        verdict = fm.SUPPORTS["bias_dropout_add_fwd"](x, randn(6), x, 0.5)
        assert not verdict and "cpu" in verdict.reason


def test_dispatch_runs_flagos(monkeypatch, device):
    manager = flagos_and_reference(monkeypatch, device)
    x = randn(5, 8, device=device)
    (out, mask), impl = manager.dispatcher("bias_dropout_add_fwd").traced(x, randn(8, device=device), x, 0.5)
    assert impl.impl_id == flagos.IMPL_ID and mask.shape == (packed_bytes(x.numel()),)
    _, impl = manager.dispatcher("dropout_fwd").traced(x.double(), 0.5)  # declined: the reference runs
    assert impl.impl_id == reference.IMPL_ID
    _, impl = manager.dispatcher("dropout_bwd_dbias").traced(x, mask, 0.5)
    assert impl.impl_id == flagos.IMPL_ID


@pytest.mark.gpu
def test_dropout_large_gpu():
    x, dy = randn(8192, 4096, dtype=torch.bfloat16, device="cuda"), randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    y, mask = fm.dropout_fwd(x, 0.1)
    keep = unpack_keep(mask, x.shape)
    assert abs(keep.double().mean().item() - 0.9) < _keep_bound(0.1, keep.numel())
    assert not bool(y[~keep].any())
    assert_close(y, (x.double() * keep / 0.9).to(torch.bfloat16))
    assert_close(fm.dropout_bwd(dy, mask, 0.1), (dy.double() * keep / 0.9).to(torch.bfloat16))
    y, mask = fm.dropout_fwd(x, 0.5)
    assert torch.equal(y, x * unpack_keep(mask, x.shape) * 2)


@pytest.mark.gpu
def test_dropout_bwd_dbias_large_gpu():
    _check_dropout_bwd_dbias(randn(8192, 4096, dtype=torch.bfloat16, device="cuda"), 0.1, "cuda")
    _check_dropout_bwd_dbias(randn(4, 2048, 4104, dtype=torch.float16, device="cuda"), 0.1, "cuda")


@pytest.mark.gpu
def test_bias_dropout_add_large_gpu():
    x, residual = randn(8192, 4096, dtype=torch.bfloat16, device="cuda"), randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    bias = randn(4096, dtype=torch.bfloat16, device="cuda")
    out, mask = fm.bias_dropout_add_fwd(x, bias, residual, 0.1)
    keep = unpack_keep(mask, x.shape)
    assert abs(keep.double().mean().item() - 0.9) < _keep_bound(0.1, keep.numel())
    assert_close(out, (residual.double() + (x.double() + bias.double()) * keep / 0.9).to(torch.bfloat16))


def _targets(n, vocab, device):
    target = torch.randint(0, vocab, (n,))
    target[1] = -100  # ignored row
    return target.to(device)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("vocab", [1, 37, 5003])  # 5003: two blocks of the online logsumexp
def test_cross_entropy(vocab, dtype, label_smoothing, device):
    logits = randn(4, vocab, dtype=dtype, scale=4.0, device=device)
    target = _targets(4, vocab, device)
    loss, lse = fm.cross_entropy_fwd(logits, target, label_smoothing)
    loss_ref, lse_ref = ref.cross_entropy_fwd(logits, target, label_smoothing)
    assert_close(loss, loss_ref, reduction=True)
    assert_close(lse, lse_ref, reduction=True)
    assert loss[1].item() == 0.0
    grad = randn(4, device=device)
    dz = fm.cross_entropy_bwd(grad, logits, target, lse_ref, label_smoothing)
    assert_close(dz, ref.cross_entropy_bwd(grad, logits, target, lse_ref, label_smoothing), reduction=True)
    assert not bool(dz[1].cpu().any())


def test_broadcast_grad_strided_logits_custom_ignore_index(device):
    logits = randn(3, 40, device=device)[:, 2:35]  # row stride 40
    target = torch.tensor([4, 7, 0], device=device)
    loss, lse = fm.cross_entropy_fwd(logits, target, 0.0, 7)
    assert_close(loss, ref.cross_entropy_fwd(logits, target, 0.0, 7)[0], reduction=True)
    grad = torch.ones(1, device=device).expand(3)  # the mean-reduction gradient, stride 0
    assert_close(fm.cross_entropy_bwd(grad, logits, target, lse, 0.0, 7), ref.cross_entropy_bwd(grad, logits, target, lse, 0.0, 7),
                 reduction=True)


def test_out_of_range_target_gives_nan(device):
    loss, _ = fm.cross_entropy_fwd(randn(2, 5, device=device), torch.tensor([1, 5], device=device))
    assert math.isfinite(loss[0].item()) and math.isnan(loss[1].item())


def test_errors_and_supports(device):
    logits = randn(2, 5, device=device)
    with pytest.raises(ValueError, match="2-D"):
        fm.cross_entropy_fwd(logits[None], torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="integer"):
        fm.cross_entropy_fwd(logits, torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="lse"):
        fm.cross_entropy_bwd(torch.ones(2, device=device), logits, torch.zeros(2, dtype=torch.long, device=device),
                             torch.ones(3, device=device))
    if device == "cuda":
        verdict = fm.SUPPORTS["cross_entropy_fwd"](logits, torch.zeros(2, dtype=torch.long))
        assert not verdict and "cpu" in verdict.reason
    assert fm.SUPPORTS["cross_entropy_fwd"](logits, torch.zeros(2, dtype=torch.long, device=device))


@pytest.mark.gpu
def test_large_gpu():
    logits = randn(4097, 32003, dtype=torch.bfloat16, scale=4.0, device="cuda")
    target = _targets(4097, 32003, "cuda")
    loss, lse = fm.cross_entropy_fwd(logits, target, 0.1)
    loss_ref, lse_ref = ref.cross_entropy_fwd(logits, target, 0.1)
    assert_close(loss, loss_ref, reduction=True)
    assert_close(lse, lse_ref, reduction=True)
    grad = randn(4097, device="cuda")
    assert_close(fm.cross_entropy_bwd(grad, logits, target, lse, 0.1), ref.cross_entropy_bwd(grad, logits, target, lse_ref, 0.1))
