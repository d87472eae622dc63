"""The "p2p" ring of context parallelism (see :mod:`.context_parallel` for the layout and the math).

K/V blocks travel rank r -> r+1 (isend / irecv posted before the block's compute); each block's partial output and
log-sum-exp merge exactly; the backward runs the same ring with the global lse, each block's dK / dV accumulator
travelling with it. The block math is plain PyTorch in float32 (the catalog's attention op returns no log-sum-exp).

An attention bias (TE's ``core_attention_bias``, "pre_scale_bias" / "post_scale_bias") holds this rank's query rows
and every key column in sequence order, [1 or b, 1 or h, 1 or s_q, S_kv]; the block of rank j's keys adds the
columns at j's positions (S = scale (q k^T + B), or scale q k^T + B), and its gradient dB = dS (times the scale
for "pre_scale_bias") collects into those columns, summed over broadcast dimensions.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .context_parallel_packed import packed_hidden

if TYPE_CHECKING:
    from .context_parallel import CPAttention, CPGroup

__all__ = ["RingAttention"]


class _Ring:
    """Point-to-point messages to the next rank of the group and from the previous one."""

    def __init__(self, cp: CPGroup):
        size, rank = cp.size, cp.rank
        self.group, self.rank, self.size = cp.group, rank, size
        self.next, self.prev = cp.global_rank((rank + 1) % size), cp.global_rank((rank - 1) % size)

    def shift(self, x: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Post send(x -> next) and recv(<- prev); the returned function waits and gives what arrived."""
        x = x.contiguous()
        buf = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for work in works:  # the sent x stays referenced by ops until its send completed
                work.wait()
            ops.clear()
            return buf

        return wait


def _pack(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    sizes = [x.numel() for x in like]
    return [part.view(x.shape) for part, x in zip(flat.split(sizes), like)]


def _blocks(step: int, ring: _Ring, settings: CPAttention, s_q: int, s_kv: int, device):
    """(query rows, key rows, hidden) of the step's block for this rank (see the module docstring); hidden: bool
    [rows, keys], True where the mask hides a key from a query, or None (nothing hidden)."""
    every_q, every_kv = slice(0, s_q), slice(0, s_kv)
    src = (ring.rank - step) % ring.size
    if settings.packed is not None:
        return every_q, every_kv, packed_hidden(settings.packed, ring.rank, src, ring.size, settings.causal, settings.window_size, device)
    if tuple(settings.window_size) not in ((-1, -1), (-1, 0)):
        return every_q, every_kv, _window_hidden(settings, ring, src, s_q, device)
    if not settings.causal:
        return every_q, every_kv, None
    if src == ring.rank:  # the local order of positions is increasing: the diagonal block's causal mask is top-left
        return every_q, every_kv, torch.ones(s_q, s_kv, dtype=torch.bool, device=device).triu_(1)
    if src < ring.rank:
        return every_q, slice(0, s_kv // 2), None
    return slice(s_q // 2, s_q), every_kv, None


def _positions(rank: int, size: int, length: int, device) -> torch.Tensor:
    """Sequence positions of a rank's 2L tokens: chunks ``rank`` and 2P-1-``rank`` of L tokens."""
    first = torch.arange(length, device=device)
    return torch.cat([rank * length + first, (2 * size - 1 - rank) * length + first])


def _window_hidden(settings: CPAttention, ring: _Ring, src: int, s_local: int, device) -> torch.Tensor:
    """What a sliding window (and the causal mask) hides in the block of this rank's queries and rank ``src``'s keys:
    key position j is hidden from query position i where j - i > right (0 when causal) or i - j > left."""
    length = s_local // 2
    offset = _positions(src, ring.size, length, device)[None, :] - _positions(ring.rank, ring.size, length, device)[:, None]
    left, right = settings.window_size
    right = 0 if settings.causal else right
    hidden = offset > right if right >= 0 else torch.zeros_like(offset, dtype=torch.bool)
    return hidden | (offset < -left) if left >= 0 else hidden


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """float32 [b, h, s, d] from "bshd"."""
    return x.float().transpose(1, 2)


def _probs(q, k, scale: float, hidden: Optional[torch.Tensor], lse: Optional[torch.Tensor] = None,
           bias: Optional[torch.Tensor] = None):
    """(P, lse) of one block: S = scale q k^T (+ ``bias``, already scaled as its type says) with -inf where
    ``hidden``, P = exp(S - lse).

    q [b, h, s_q, d] and k [b, h, s_kv, d] (kv heads expanded); ``lse`` None means this block's own. A row
    whose keys are all hidden has lse = -inf and P = 0.
    """
    scores = scale * (q @ k.transpose(-1, -2))
    if bias is not None:
        scores = scores + bias
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse).unsqueeze(-1)), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no visible key) as 0, so that exp(-inf - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _merge(out, lse, rows: slice, o_b, lse_b) -> None:
    """out, lse over rows <- the exact merge with a block's (o_b, lse_b) (see the module docstring)."""
    new = torch.logaddexp(lse[..., rows], lse_b)
    weight_old, weight_b = torch.exp(lse[..., rows] - _finite(new)), torch.exp(lse_b - _finite(new))
    out[..., rows, :] = out[..., rows, :] * weight_old.unsqueeze(-1) + o_b * weight_b.unsqueeze(-1)
    lse[..., rows] = new


def _dropout_scale(p: torch.Tensor, dropout_p: float) -> Optional[torch.Tensor]:
    """Z = keep / (1 - dropout_p) for a block of probabilities ``p`` (keep ~ Bernoulli(1 - dropout_p), drawn from
    the current generator of p's device), or None without dropout."""
    if dropout_p == 0.0:
        return None
    keep = torch.rand(p.shape, dtype=torch.float32, device=p.device) >= dropout_p
    return keep.float() / (1.0 - dropout_p)


def _rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator the dropout masks of ``device`` are drawn from."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _replayed_rng(device: torch.device, state: torch.Tensor):
    """The generator of ``device`` set to ``state`` inside (the forward's masks drawn again), as it was after."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the CPU generator is always forked
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


def _bias_factor(settings: CPAttention) -> float:
    """What multiplies the bias in S (and dS in its gradient): the softmax scale before it, 1 after it."""
    return settings.softmax_scale if settings.bias_type == "pre_scale_bias" else 1.0


def _bias_columns(ring: _Ring, src: int, s_kv: int, cols: slice, device) -> torch.Tensor:
    """The sequence positions of the keys of rank ``src`` that a block reads (its ``cols``): the bias columns."""
    return _positions(src, ring.size, s_kv // 2, device)[cols]


def _bias_rows(bias: torch.Tensor, rows: slice) -> torch.Tensor:
    """The bias rows of a block's queries (all of a bias broadcast over the queries)."""
    return bias if bias.shape[-2] == 1 else bias[..., rows, :]


def _bias_block(bias: Optional[torch.Tensor], settings: CPAttention, ring: _Ring, step: int, rows: slice, cols: slice, s_kv: int,
                device) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(the step's block's additive term of S, its key columns): the bias at the block's query rows and at the
    positions of its keys, scaled as its type says; (None, None) without a bias."""
    if bias is None:
        return None, None
    columns = _bias_columns(ring, (ring.rank - step) % ring.size, s_kv, cols, device)
    return _bias_factor(settings) * _bias_rows(bias, rows).index_select(-1, columns).float(), columns


def _ring_forward(q, k, v, bias, settings: CPAttention, ring: _Ring):
    """(out [b, h, s_q, d_v], lse [b, h, s_q]) in float32; q, k, v "bshd". With dropout the block's probabilities
    (normalised by the block's lse, rescaled by the merge) are multiplied by their mask Z before P V."""
    qh = _heads_first(q)
    heads, s_q, s_kv = qh.shape[1], q.shape[1], k.shape[1]
    out = qh.new_zeros(*qh.shape[:-1], v.shape[-1])
    lse = qh.new_full(qh.shape[:-1], float("-inf"))
    kv = _pack(k, v)
    for step in range(ring.size):
        arriving = ring.shift(kv) if step < ring.size - 1 else None  # overlaps the block's compute
        k_blk, v_blk = _unpack(kv, (k, v))
        rows, cols, hidden = _blocks(step, ring, settings, s_q, s_kv, q.device)
        kh, vh = _expand(_heads_first(k_blk[:, cols]), heads), _expand(_heads_first(v_blk[:, cols]), heads)
        block_bias, _ = _bias_block(bias, settings, ring, step, rows, cols, s_kv, q.device)
        p, lse_b = _probs(qh[:, :, rows], kh, settings.softmax_scale, hidden, bias=block_bias)
        z = _dropout_scale(p, settings.dropout_p)
        _merge(out, lse, rows, (p if z is None else p * z) @ vh, lse_b)
        if arriving is not None:
            kv = arriving()
    return out, lse


def _block_grads(qh, doh, lse, delta, k_blk, v_blk, settings: CPAttention, hidden: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor] = None):
    """(dq, dk, dv, dS) float32 of one block given the global lse and D (see the module docstring); with dropout,
    the forward's mask Z drawn again: dV = (P Z)^T dO, dS = P (Z dO V^T - D), D = rowsum(dO O) of the dropped O."""
    heads, heads_kv = qh.shape[1], k_blk.shape[2]
    kh, vh = _expand(_heads_first(k_blk), heads), _expand(_heads_first(v_blk), heads)
    p, _ = _probs(qh, kh, settings.softmax_scale, hidden, lse, bias=bias)
    z = _dropout_scale(p, settings.dropout_p)
    dp = doh @ vh.transpose(-1, -2)
    ds = p * ((dp if z is None else dp * z) - delta.unsqueeze(-1))
    scale = settings.softmax_scale
    dk = (scale * ds.transpose(-1, -2) @ qh).unflatten(1, (heads_kv, -1)).sum(dim=2)
    dv = ((p if z is None else p * z).transpose(-1, -2) @ doh).unflatten(1, (heads_kv, -1)).sum(dim=2)
    return scale * (ds @ kh), dk.transpose(1, 2), dv.transpose(1, 2), ds


def _ring_backward(dout, q, k, v, bias, out, lse, settings: CPAttention, ring: _Ring):
    """(dq, dk, dv, dbias) in the inputs' dtypes (dbias None without a bias): the forward's ring again, with dK/dV
    travelling with K/V."""
    qh, doh = _heads_first(q), _heads_first(dout)
    delta = (doh * out).sum(dim=-1)
    s_q, s_kv = q.shape[1], k.shape[1]
    dq = torch.zeros_like(qh)
    dbias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    kv, dkv_arriving = _pack(k, v), None
    for step in range(ring.size):
        arriving = ring.shift(kv) if step < ring.size - 1 else None
        k_blk, v_blk = _unpack(kv, (k, v))
        rows, cols, hidden = _blocks(step, ring, settings, s_q, s_kv, q.device)
        block_bias, columns = _bias_block(bias, settings, ring, step, rows, cols, s_kv, q.device)
        dq_b, dk_b, dv_b, ds = _block_grads(qh[:, :, rows], doh[:, :, rows], lse[..., rows], delta[..., rows],
                                            k_blk[:, cols], v_blk[:, cols], settings, hidden, block_bias)
        dq[:, :, rows] += dq_b
        if dbias is not None:
            target = _bias_rows(dbias, rows)
            target.index_add_(-1, columns, _bias_factor(settings) * _sum_to(ds, target.shape))
        dkv = dkv_arriving() if dkv_arriving is not None else k.new_zeros(k.numel() + v.numel(), dtype=torch.float32)
        dk_acc, dv_acc = _unpack(dkv, (k, v))
        dk_acc[:, cols] += dk_b
        dv_acc[:, cols] += dv_b
        dkv_arriving = ring.shift(dkv)  # the block's gradient follows the block; after P hops it is home
        if arriving is not None:
            kv = arriving()
    dk, dv = _unpack(dkv_arriving(), (k, v))
    return dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if dbias is None else dbias.to(bias.dtype)


def _sum_to(x: torch.Tensor, shape) -> torch.Tensor:
    """x [b, h, r, c] summed over the leading dims where ``shape`` has 1 (a bias broadcast there; columns as x's)."""
    dims = [d for d in range(3) if shape[d] == 1 and x.shape[d] != 1]
    return x.sum(dim=dims, keepdim=True) if dims else x


class RingAttention(torch.autograd.Function):
    """"p2p" context parallelism: ring forward with the log-sum-exp merge, ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias: Optional[torch.Tensor], settings: CPAttention, cp: CPGroup):
        ctx.rng_state = _rng_state(q.device) if settings.dropout_p > 0 else None  # backward draws the masks again
        out, lse = _ring_forward(q, k, v, bias, settings, _Ring(cp))
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.settings, ctx.cp = settings, cp
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out, lse = ctx.saved_tensors
        replay = _replayed_rng(q.device, ctx.rng_state) if ctx.rng_state is not None else contextlib.nullcontext()
        with replay:
            dq, dk, dv, dbias = _ring_backward(dout, q, k, v, bias, out, lse, ctx.settings, _Ring(ctx.cp))
        return dq, dk, dv, dbias if ctx.needs_input_grad[3] else None, None, None
