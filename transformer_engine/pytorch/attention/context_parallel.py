"""Context parallelism (CP): one attention call whose sequence is split over the ranks of ``cp_group``.

Layout (TE's "DualChunkSwap", for every mask type): a sequence of length S is cut into 2P chunks of
L = S / (2P) tokens (P = CP size) and rank r holds chunks r and 2P-1-r, concatenated, so every rank
gets the same amount of causal work. The caller (the data loader) arranges the tokens that way;
:func:`shard_sequence` does it for one tensor. All gathered / exchanged blocks below are in
"gathered order" (rank 0's two chunks, rank 1's two chunks, ...): chunk c of the sequence sits at
gathered slot g(c) = 2c for c < P and 2(2P-1-c) + 1 otherwise.

Communication types (TE's ``cp_comm_type``):

- ``"all_gather"``: K and V are all-gathered and put back in sequence order; each local query chunk c
  attends to the keys it may see with the catalog's ``fused_attn_fwd`` (causal: keys [0, (c+1)L) with
  the bottom-right causal mask, which puts query row i at position cL + i; sliding windows are
  re-aligned the same way). A causal chunk with c > 0 runs as two blocks merged by their log-sum-exp
  (:mod:`.blockwise`): keys [0, cL) unmasked and its diagonal [cL, (c+1)L) causal, both on cuDNN where
  the whole chunk's bottom-right mask needed a slower kernel. The backward of the gather is a
  reduce-scatter of dK, dV.
- ``"p2p"``: a ring. K/V blocks travel rank r -> r+1 (isend / irecv posted before the block's compute,
  so they overlap it); after P steps every query has met every key block. Each block gives a partial
  output O_b normalised over its own keys and its log-sum-exp lse_b; they merge exactly:

      lse = log(sum_b exp(lse_b))          (pairwise: max + log1p(exp(min - max)))
      O   = sum_b exp(lse_b - lse) O_b

  Causal blocks (rank r, K/V from rank j): j = r is the diagonal (local causal mask), j < r is seen in
  full by both query chunks but only through its first chunk (chunk j), j > r only by the second query
  chunk (chunk 2P-1-r), in full. With a sliding window every block is computed whole, masked by the
  sequence positions of its queries and keys (a query row with no key in the window contributes
  lse_b = -inf, P_b = 0); packed sequences ("thd", :mod:`.context_parallel_packed`) likewise, by sequence,
  position and padding. Dropout multiplies each block's probabilities by a mask Z = keep / (1 - p) drawn
  on the rank (dropping after the softmax commutes with the merge's rescaling); the backward draws the
  same masks again from the generator state the forward started from. The backward runs the same ring
  with the global lse and
  D_i = sum_d dO_id O_id: P_b = exp(S_b - lse), dS_b = P_b (dO V_b^T - D), dQ += scale dS_b K_b,
  dK_b = scale dS_b^T Q, dV_b = P_b^T dO; the dK/dV accumulator of a block travels with it and is
  home after the P-th hop.
- ``"a2a+p2p"`` (hierarchical, TE's ``cp_group=[a2a_group, p2p_group]``): P = A P' ranks, rank r = p A + a
  (``a`` its rank in its a2a group of A consecutive ranks, ``p`` in its p2p group). An all-to-all within the a2a group
  trades heads for the group's tokens: fine chunks pA + a and 2P-1-pA-a of the A members are coarse chunks p and
  2P'-1-p of a 2P'-chunk split (the first halves in order of a, the second halves in reverse), which is the "p2p"
  layout of rank p of P', so the ring runs over the p2p group on H/A heads, and a second all-to-all trades back.
- ``"a2a"``: Ulysses. An all-to-all trades the sequence split for a head split (each rank gets all S
  tokens of H/P heads), the catalog op attends over the whole sequence, and a second all-to-all
  trades back. Its backward is the same two all-to-alls in reverse. Packed sequences ("thd") come back as
  the whole packed batch in TE's padded layout, which the module attends as it does without CP.

"p2p" runs its blocks through the catalog's block ops (``attention_block_fwd`` / ``_bwd``: each block's O and
log-sum-exp, and its share of the gradients from the merged ones; :mod:`.context_parallel_ring`); "all_gather" and
"a2a" run ``fused_attn_fwd`` / ``_bwd``; each on whichever backend the dispatch picks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from transformer_engine.plugin.catalog.attention import AttentionConfig

from ..parallel.comm import gather_from_sequence_parallel_region, group_rank, group_size
from .blockwise import blockwise_attention
from .context_parallel_packed import PackedCall, PackedSequences
from .context_parallel_ring import RingAttention

__all__ = [
    "CP_COMM_TYPES",
    "CPGroup",
    "CPAttention",
    "PackedCall",
    "PackedSequences",
    "check_cp_group",
    "check_cp_bias",
    "check_cp_call",
    "context_parallel_attention",
    "shard_sequence",
]

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")

# attend(q, k, v, softmax_offset, config) -> out: the module's catalog call (bshd in, bshd out; with a PackedCall
# instead of the config, thd [t, h, d] in and out)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Union[AttentionConfig, PackedCall]], torch.Tensor]


@dataclass(frozen=True, eq=False)
class CPGroup:
    """TE's context-parallel settings of a module (``set_context_parallel_group``'s arguments).

    Attributes:
        group: the process group whose ranks share the sequence; for "a2a+p2p" the pair [a2a group, p2p group].
        global_ranks: global ranks of the (whole) group (None: asked from torch.distributed).
        stream: accepted for TE compatibility; communication here is asynchronous isend / irecv on
            the current stream, so no side stream is used.
        comm_type: "p2p", "all_gather" or "a2a".
    """

    group: Any
    global_ranks: Optional[Sequence[int]]
    stream: Any
    comm_type: str

    @property
    def size(self) -> int:
        if self.comm_type == "a2a+p2p":
            return group_size(self.group[0]) * group_size(self.group[1])
        return group_size(self.group)

    @property
    def rank(self) -> int:
        """The rank in the whole group (for "a2a+p2p": p A + a)."""
        if self.comm_type == "a2a+p2p":
            return group_rank(self.group[1]) * group_size(self.group[0]) + group_rank(self.group[0])
        return group_rank(self.group)

    def hierarchy(self) -> Tuple["CPGroup", "CPGroup"]:
        """("a2a+p2p") the a2a group and the p2p group, the latter with the global ranks of its members."""
        a2a_group, p2p_group = self.group
        a2a = CPGroup(a2a_group, None, self.stream, "a2a")
        ranks = None
        if self.global_ranks is not None:
            ranks = [self.global_ranks[p * a2a.size + a2a.rank] for p in range(group_size(p2p_group))]
        return a2a, CPGroup(p2p_group, ranks, self.stream, "p2p")

    def global_rank(self, rank: int) -> int:
        """Global rank of the group's ``rank`` (for point-to-point messages)."""
        if self.global_ranks is not None:
            return int(self.global_ranks[rank])
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


@dataclass(frozen=True)
class CPAttention:
    """The non-tensor settings of one context-parallel attention call.

    Attributes:
        causal: causal mask (TE's "causal" / "causal_bottom_right": the same for self-attention).
        window_size: (left, right) sliding window in sequence positions, -1 unbounded.
        softmax_scale: multiplier of Q K^T.
        dropout_p: attention dropout (drawn per rank from its own generator).
        softmax_type: "vanilla" ("off-by-one" / "learnable" with "a2a" only, as TE).
        packed: the packed sequences of a "thd" call, else None.
        bias_type: "no_bias", or "pre_scale_bias" / "post_scale_bias" ("p2p" only; see :mod:`.context_parallel_ring`).
    """

    causal: bool
    window_size: Tuple[int, int]
    softmax_scale: float
    dropout_p: float = 0.0
    softmax_type: str = "vanilla"
    packed: Optional[PackedSequences] = None
    bias_type: str = "no_bias"

    @property
    def windowed(self) -> bool:
        """True when a sliding window hides keys that the mask type alone does not ((-1, 0) is the causal mask's)."""
        return tuple(self.window_size) not in ((-1, -1), (-1, 0))


def check_cp_group(cp_group, cp_global_ranks, cp_comm_type: str) -> None:
    """Validate ``set_context_parallel_group``'s arguments (before any work).

    Raises:
        ValueError: an unknown ``cp_comm_type`` or ``cp_global_ranks`` of the wrong length.
        TypeError: ``cp_group`` is not a ProcessGroup ("a2a+p2p": not a pair [a2a_group, p2p_group] of them).
    """
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type={cp_comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
    if cp_group is None:
        return
    hierarchical = cp_comm_type == "a2a+p2p"
    groups = list(cp_group) if hierarchical and isinstance(cp_group, (list, tuple)) else [cp_group]
    if hierarchical and len(groups) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in groups):
        wanted = "a pair [a2a_group, p2p_group] of torch.distributed ProcessGroups" if hierarchical else "a torch.distributed ProcessGroup"
        raise TypeError(f"cp_group for cp_comm_type={cp_comm_type!r} must be {wanted}, got {cp_group!r}")
    size = group_size(groups[0]) * (group_size(groups[1]) if hierarchical else 1)
    if cp_global_ranks is not None and len(cp_global_ranks) != size:
        raise ValueError(f"cp_global_ranks has {len(cp_global_ranks)} ranks; the context-parallel group has {size}")


def check_cp_call(cp: CPGroup, fmt: str, mask_type: str, window_size, *, bias_type: str, inference: bool,
                  softmax_type: str, dropout_p: float, q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse, before any communication, what context parallelism does not do (yet).

    q and k are in "bshd" order ([b, s_local, h, d]); for "thd" a batch of one packed row ([1, t_local, h, d], whose
    offsets :meth:`PackedSequences.from_offsets` checks).

    Raises:
        NotImplementedError: KV caching, padding masks outside "thd", arbitrary masks, ALiBi; biases except with
            "p2p" and no padding; softmax offsets except with "a2a".
        ValueError: odd local sequence lengths, q / k lengths that differ under a causal mask or a
            window, head counts that "a2a" cannot split over the group.
    """
    name = f"context parallelism (cp_comm_type={cp.comm_type!r})"
    if inference:
        raise NotImplementedError(f"{name} does not support inference_params (KV caching)")
    masks = ("no_mask", "causal", "causal_bottom_right")
    if fmt == "thd":
        masks += tuple(f"padding_{m}" if m != "no_mask" else "padding" for m in masks)
    if mask_type not in masks:
        raise NotImplementedError(f"{name} with qkv_format={fmt!r} supports attn_mask_type {' / '.join(masks)}, not {mask_type!r}")
    if bias_type not in ("no_bias", "pre_scale_bias", "post_scale_bias") or (bias_type != "no_bias" and (
            cp.comm_type != "p2p" or "padding" in mask_type or fmt == "thd")):
        raise NotImplementedError(f"{name} with qkv_format={fmt!r}, attn_mask_type={mask_type!r} does not support "
                                  f"core_attention_bias_type={bias_type!r}; a bias (pre_scale_bias / post_scale_bias) works "
                                  "with cp_comm_type='p2p' and no padding, as in TE")
    if softmax_type != "vanilla" and cp.comm_type != "a2a":
        raise NotImplementedError(f"{name} supports softmax_type={softmax_type!r} only with cp_comm_type='a2a'")
    if cp.comm_type in ("a2a", "a2a+p2p"):
        size = cp.size if cp.comm_type == "a2a" else cp.hierarchy()[0].size
        if q.shape[-2] % size or k.shape[-2] % size:
            raise ValueError(f"{name}: {q.shape[-2]} query and {k.shape[-2]} key/value heads must divide by the a2a size {size}")
    if fmt == "thd":
        return
    s_q, s_kv = q.shape[1], k.shape[1]
    if s_q % 2 or s_kv % 2:
        raise ValueError(f"{name}: each rank holds two sequence chunks, so its q / k lengths ({s_q}, {s_kv}) must be even")
    if s_q != s_kv and (mask_type != "no_mask" or tuple(window_size) != (-1, -1)):
        raise ValueError(f"{name}: causal masks and windows need equal q and k lengths per rank, got {s_q} and {s_kv}")


def check_cp_bias(bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, size: int) -> None:
    """A bias of this rank's query rows and every key column ("bshd" q, k: [b, s_local, h, d]).

    Raises:
        ValueError: a shape other than [1 or b, 1 or h, 1 or s_q, S_kv] (S_kv = P s_kv of the whole sequence).
    """
    b, s_q, h = q.shape[:3]
    s_kv = k.shape[1] * size
    ok = bias.dim() == 4 and bias.shape[0] in (1, b) and bias.shape[1] in (1, h) and bias.shape[2] in (1, s_q) and bias.shape[3] == s_kv
    if not ok:
        raise ValueError(f"context parallelism: core_attention_bias {tuple(bias.shape)} must be [1 or {b}, 1 or {h}, 1 or {s_q}, {s_kv}] "
                         "(this rank's query rows, as it holds them, and every key column in sequence order)")


def shard_sequence(x: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s part of a full sequence: chunks r and 2P-1-r of 2P, concatenated.

    Example:
        >>> shard_sequence(torch.arange(8), 0, 2, 0).tolist()
        [0, 1, 6, 7]
    """
    if x.shape[seq_dim] % (2 * cp_size):
        raise ValueError(f"sequence length {x.shape[seq_dim]} must be a multiple of 2 * cp_size = {2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim=seq_dim)


def _natural_index(size: int, device) -> torch.Tensor:
    """index[c] = gathered slot of sequence chunk c (2c for c < P, 2(2P-1-c) + 1 after)."""
    return torch.tensor([2 * c if c < size else 2 * (2 * size - 1 - c) + 1 for c in range(2 * size)], device=device)


def _gathered_index(size: int, device) -> torch.Tensor:
    """The inverse permutation: index[g] = sequence chunk in gathered slot g = 2r + half."""
    return torch.tensor([r if half == 0 else 2 * size - 1 - r for r in range(size) for half in (0, 1)], device=device)


def _to_natural(x: torch.Tensor, size: int) -> torch.Tensor:
    """[b, 2P*L, ...] in gathered order -> sequence order."""
    chunks = x.unflatten(1, (2 * size, -1))
    return chunks.index_select(1, _natural_index(size, x.device)).flatten(1, 2)


def _to_gathered(x: torch.Tensor, size: int) -> torch.Tensor:
    """[b, 2P*L, ...] in sequence order -> gathered order (the inverse of :func:`_to_natural`)."""
    chunks = x.unflatten(1, (2 * size, -1))
    return chunks.index_select(1, _gathered_index(size, x.device)).flatten(1, 2)


def context_parallel_attention(q, k, v, settings: CPAttention, cp: CPGroup, attend: Attend,
                               softmax_offset: Optional[torch.Tensor] = None,
                               rng_ctx: Callable[[], ContextManager] = contextlib.nullcontext,
                               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence; q, k, v and the result are "bshd".

    Call :func:`check_cp_call` (and :func:`check_cp_bias`) first. ``attend`` runs the catalog op ("all_gather",
    "a2a", which enters ``rng_ctx`` itself); "p2p" and all_gather's blockwise chunks draw their dropout masks inside
    ``rng_ctx()`` (e.g. a model-parallel RNG tracker); "p2p" adds ``bias`` (``settings.bias_type``).
    """
    if cp.comm_type == "all_gather":
        return _all_gather_attention(q, k, v, settings, cp, attend, softmax_offset, rng_ctx)
    if cp.comm_type == "a2a":
        return _a2a_attention(q, k, v, settings, cp, attend, softmax_offset)
    with rng_ctx():
        if cp.comm_type == "a2a+p2p":
            return _hierarchical_attention(q, k, v, settings, cp)
        return RingAttention.apply(q, k, v, bias, settings, cp)


# ---------------------------------------------------------------------------------------- all_gather


def _gather_sequence(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """[b, 2L, h, d] local -> [b, 2PL, h, d] in sequence order; the gradient is reduce-scattered back."""
    gathered = gather_from_sequence_parallel_region(x.transpose(0, 1), cp.group).transpose(0, 1)
    return _to_natural(gathered, cp.size)


def _chunk_window(settings: CPAttention, chunk: int, length: int, s_kv: int) -> Tuple[int, int, int]:
    """(key end, window left, window right) for query chunk ``chunk`` against keys [0, end).

    The catalog aligns windows and the causal mask bottom-right: with keys [0, end) query row i
    sits at end - L + i; the chunk's rows are at chunk*L + i, so the window shifts by
    end - (chunk+1)*L (TE's ``get_kv_seq_info_after_all_gather``).
    """
    chunk_end = (chunk + 1) * length
    left, right = settings.window_size
    if settings.causal:
        right = 0
    end = s_kv if right < 0 else min(s_kv, chunk_end + right)
    shift = end - chunk_end
    return end, (left + shift if left >= 0 else -1), (right - shift if right >= 0 else -1)


def _all_gather_attention(q, k, v, settings: CPAttention, cp: CPGroup, attend: Attend, softmax_offset, rng_ctx) -> torch.Tensor:
    """Each query chunk against the keys up to its end; a causal chunk after the first (vanilla softmax, no window)
    as two blocks, the keys before it and its causal diagonal (:func:`.blockwise.blockwise_attention`), which run
    where the whole chunk's bottom-right causal mask would need a slower kernel or a bias."""
    if settings.packed is not None:
        return _all_gather_packed(q, k, v, settings, cp, attend, softmax_offset)
    k_full, v_full = _gather_sequence(k, cp), _gather_sequence(v, cp)
    length, s_kv = q.shape[1] // 2, k_full.shape[1]
    split = settings.causal and not settings.windowed and settings.softmax_type == "vanilla"
    outs = []
    for q_chunk, chunk in zip(q.chunk(2, dim=1), (cp.rank, 2 * cp.size - 1 - cp.rank)):
        end, left, right = _chunk_window(settings, chunk, length, s_kv)
        if split and end > length:
            with rng_ctx():
                blocks = ((slice(0, end - length), "no_mask"), (slice(end - length, end), "causal"))
                outs.append(blockwise_attention(q_chunk, k_full[:, :end], v_full[:, :end], blocks, settings))
            continue
        config = AttentionConfig(
            softmax_scale=settings.softmax_scale,
            mask_type="causal_bottom_right" if settings.causal else "no_mask",
            window_size=(left, right) if not settings.causal or left >= 0 else (-1, -1),
            dropout_p=settings.dropout_p,
            softmax_type=settings.softmax_type,
        )
        outs.append(attend(q_chunk, k_full[:, :end], v_full[:, :end], softmax_offset, config))
    return torch.cat(outs, dim=1)


def _all_gather_packed(q, k, v, settings: CPAttention, cp: CPGroup, attend: Attend, softmax_offset) -> torch.Tensor:
    """Packed sequences ([1, t, h, d]): K and V gathered into the whole packed batch, each local query chunk attending
    its sequence's keys up to its last real query (:meth:`PackedSequences.chunk_call`, checked before the gather)."""
    call, rows = settings.packed.chunk_call(cp.rank, cp.size, causal=settings.causal, window=settings.window_size, device=q.device)
    natural = settings.packed.natural_order(cp.size, kv=True, device=q.device)
    k_full, v_full = (gather_from_sequence_parallel_region(x[0], cp.group).index_select(0, natural) for x in (k, v))
    return attend(q[0], k_full.index_select(0, rows), v_full.index_select(0, rows), softmax_offset, call)[None]


# ----------------------------------------------------------------------------------------------- a2a


class _AllToAll(torch.autograd.Function):
    """y[p] = x[rank] of rank p, for x, y [P, ...]: its own transpose, so the backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return _all_to_all(dy, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_sequence(x: torch.Tensor, cp: CPGroup, packed: Optional[PackedSequences], kv: bool) -> torch.Tensor:
    """[b, 2L, h, d] (local tokens, all heads) -> [b, 2PL, h/P, d] (all tokens in order, this rank's heads); a packed
    batch ([1, t, h, d]) comes back as the whole packed batch in TE's padded layout."""
    size = cp.size
    parts = x.unflatten(2, (size, -1)).movedim(2, 0)  # [P, b, 2L, h/P, d]: head group p goes to rank p
    received = _AllToAll.apply(parts, cp.group)  # [P, b, 2L, h/P, d]: rank p's tokens of my heads
    gathered = received.movedim(0, 1).flatten(1, 2)
    if packed is None:
        return _to_natural(gathered, size)
    return gathered.index_select(1, packed.natural_order(size, kv=kv, device=x.device))


def _sequence_to_heads(x: torch.Tensor, cp: CPGroup, packed: Optional[PackedSequences]) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence` (of the query side)."""
    size = cp.size
    gathered = _to_gathered(x, size) if packed is None else x.index_select(1, packed.natural_rows(size, kv=False, device=x.device))
    parts = gathered.unflatten(1, (size, -1)).movedim(1, 0)  # [P, b, 2L, h/P, d]
    received = _AllToAll.apply(parts, cp.group)  # [P, b, 2L, h/P, d]: head group p from rank p
    return received.movedim(0, 2).flatten(2, 3)


def _a2a_attention(q, k, v, settings: CPAttention, cp: CPGroup, attend: Attend, softmax_offset) -> torch.Tensor:
    packed = settings.packed
    q_full, k_full, v_full = (_heads_to_sequence(x, cp, packed, kv=x is not q) for x in (q, k, v))
    if softmax_offset is not None:
        softmax_offset = softmax_offset.chunk(cp.size)[cp.rank]
    if packed is not None:  # the whole packed batch of this rank's heads
        out = attend(q_full[0], k_full[0], v_full[0], softmax_offset,
                     packed.whole_call(causal=settings.causal, window=settings.window_size, device=q.device))
        return _sequence_to_heads(out[None], cp, packed)
    config = AttentionConfig(
        softmax_scale=settings.softmax_scale,
        mask_type="causal" if settings.causal else "no_mask",
        window_size=settings.window_size if settings.window_size != (-1, 0) else (-1, -1),
        dropout_p=settings.dropout_p,
        softmax_type=settings.softmax_type,
    )
    return _sequence_to_heads(attend(q_full, k_full, v_full, softmax_offset, config), cp, packed)


# ------------------------------------------------------------------------------------------- a2a+p2p


def _heads_to_coarse(x: torch.Tensor, a2a: CPGroup, order: Optional[torch.Tensor]) -> torch.Tensor:
    """[b, 2L, h, d] -> [b, 2AL, h/A, d]: the a2a group's tokens of this rank's heads in the coarse two-chunk layout
    (the members' first chunks in order, then their second chunks in reverse order); packed sequences ([1, t, h, d])
    by ``order`` (:meth:`PackedSequences.coarse_order`)."""
    size = a2a.size
    parts = x.unflatten(2, (size, -1)).movedim(2, 0)  # [A, b, 2L, h/A, d]: head group a goes to member a
    received = _AllToAll.apply(parts, a2a.group)  # [A, b, 2L, h/A, d]: member a's tokens
    if order is not None:
        return received.movedim(0, 1).flatten(1, 2).index_select(1, order)
    halves = received.unflatten(2, (2, -1))  # [A, b, 2, L, h/A, d]: member a's two chunks
    firsts, seconds = halves[:, :, 0], halves[:, :, 1].flip(0)
    return torch.cat((firsts.movedim(0, 1).flatten(1, 2), seconds.movedim(0, 1).flatten(1, 2)), dim=1)


def _coarse_to_heads(x: torch.Tensor, a2a: CPGroup, inverse: Optional[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`_heads_to_coarse` (packed sequences: by ``inverse``, :meth:`PackedSequences.coarse_inverse`)."""
    size = a2a.size
    if inverse is not None:
        parts = x.index_select(1, inverse).unflatten(1, (size, -1)).movedim(1, 0)  # [A, 1, t, h/A, d]
    else:
        firsts, seconds = (half.unflatten(1, (size, -1)).movedim(1, 0) for half in x.chunk(2, dim=1))  # [A, b, L, h/A, d]
        parts = torch.stack((firsts, seconds.flip(0)), dim=2).flatten(2, 3)  # [A, b, 2L, h/A, d]: member a's tokens
    received = _AllToAll.apply(parts, a2a.group)  # [A, b, 2L, h/A, d]: head group a from member a
    return received.movedim(0, 2).flatten(2, 3)


def _hierarchical_attention(q, k, v, settings: CPAttention, cp: CPGroup) -> torch.Tensor:
    a2a, p2p = cp.hierarchy()
    packed, orders, inverse = settings.packed, (None, None), None
    if packed is not None:  # the ring's masks read the coarse layout's tokens from the same offsets (rank p of P / A)
        orders = tuple(packed.coarse_order(cp.size, a2a.size, p2p.rank, kv=kv, device=q.device) for kv in (False, True))
        inverse = packed.coarse_inverse(cp.size, a2a.size, p2p.rank, q.device)
    q_c, k_c, v_c = (_heads_to_coarse(x, a2a, orders[x is not q]) for x in (q, k, v))
    return _coarse_to_heads(RingAttention.apply(q_c, k_c, v_c, None, settings, p2p), a2a, inverse)
