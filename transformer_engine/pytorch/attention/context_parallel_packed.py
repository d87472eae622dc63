"""Packed sequences ("thd") under context parallelism: which local tokens are which, and what a ring block hides.

TE's layout, per sequence: sequence i of padded length Lp_i (``cu_seqlens_padded``, a multiple of 2P for P
ranks) is cut into 2P chunks of c_i = Lp_i / (2P) tokens and rank r holds chunks r and 2P-1-r; a rank's
tokens are its part of sequence 0, then of sequence 1, ... (TE's ``thd_get_partitioned_indices``), so every
rank holds sum Lp_i / P tokens. Only the first len_i positions of a sequence are real tokens
(``cu_seqlens``); the rest is padding, which neither attends nor is attended to (its output and gradients
are 0, as TE zeroes them).

A local token t is described by (sequence s_t, position p_t in its sequence, real length len_t); in the
ring block of this rank's queries and rank j's keys, key k is hidden from query q where

    s_k != s_q,  or p_k >= len_k,  or p_q >= len_q,
    or (causal) p_k - p_q > 0 (top-left; bottom-right: (p_k - len_k) - (p_q - len_q) > 0),
    or (window (left, right)) the same offset > right or < -left.

The caller passes TE's global offsets (the whole packed batch), as NVIDIA TE's modules take them. They are read on
the host (a device synchronization) once per set of offset tensors: every layer of a step passes the same tensors,
and gets the same :class:`PackedSequences`, with the index tensors the first layer made.

"a2a" and "all_gather" run the module's own thd attention (the catalog op) on a :class:`PackedCall`: "a2a" on the
whole packed batch (:meth:`PackedSequences.whole_call`); "all_gather" with each local query chunk as a sequence of
its own against the keys of its sequence up to the chunk's last real query (:meth:`PackedSequences.chunk_call`;
causal masks align bottom-right, so chunk rows keep their positions).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch

__all__ = ["PackedCall", "PackedSequences", "packed_hidden"]

#: PackedSequences read lately, by their offset tensors (ids and versions) and the call's shape (oldest dropped first);
#: an entry holds its tensors, so no live tensor can take one of its ids
_MAX_READ = 8
_READ: "OrderedDict[tuple, Tuple[tuple, PackedSequences]]" = OrderedDict()


@dataclass(frozen=True, eq=False)
class _Tokens:
    """Per local token: its sequence, its position in it and the sequence's real length (int64 [t] each)."""

    seq: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor


@dataclass(frozen=True, eq=False)
class PackedCall:
    """One "thd" attention call the module runs: int32 offsets (real and padded, as TE's arguments), the mask type
    ("padding", "padding_causal" or "padding_causal_bottom_right") and the window."""

    cu_q: torch.Tensor
    cu_kv: torch.Tensor
    cu_q_padded: torch.Tensor
    cu_kv_padded: torch.Tensor
    mask_type: str
    window: Tuple[int, int]


@dataclass(frozen=True, eq=False)
class PackedSequences:
    """The packed batch of one context-parallel call, read once on the host.

    Attributes:
        lengths_q, lengths_kv: real length of each sequence (from ``cu_seqlens_q`` / ``cu_seqlens_kv``).
        padded_q, padded_kv: padded length of each sequence (from ``cu_seqlens_*_padded``).
        bottom_right: causal masks and windows align each sequence's last query with its last key.
    """

    lengths_q: Tuple[int, ...]
    lengths_kv: Tuple[int, ...]
    padded_q: Tuple[int, ...]
    padded_kv: Tuple[int, ...]
    bottom_right: bool
    _memo: Dict[tuple, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def from_offsets(cu_q, cu_kv, cu_q_padded, cu_kv_padded, bottom_right: bool, size: int, tokens_q: int,
                     tokens_kv: int, name: str) -> "PackedSequences":
        """Read TE's offsets and check them against the local q / k token counts (``name`` starts the messages); the
        same tensors, unchanged since (their version counters), and the same call give the result of the last read.

        Raises:
            ValueError: missing or malformed offsets, a padded length that 2 * P does not divide, a real length
                longer than its padded one, or local token counts that are not sum Lp_i / P.
        """
        offsets = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=cu_q_padded, cu_seqlens_kv_padded=cu_kv_padded)
        for arg, cu in offsets.items():
            if cu is None:
                raise ValueError(f"{name} with qkv_format='thd' needs {arg} (TE's global offsets of the packed batch, int32 [b + 1])")
            if cu.dim() != 1 or cu.numel() < 2 or cu.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name}: {arg} must be int32 [b + 1], got {cu.dtype} {tuple(cu.shape)}")
        tensors = tuple(offsets.values())
        key = tuple((id(cu), cu._version) for cu in tensors) + (bottom_right, size, tokens_q, tokens_kv)
        if key in _READ:
            _READ.move_to_end(key)
            return _READ[key][1]
        if len({cu.numel() for cu in offsets.values()}) != 1:
            raise ValueError(f"{name}: the four cu_seqlens must have the same number of sequences, got shapes "
                             f"{[tuple(cu.shape) for cu in offsets.values()]}")
        lengths_q, lengths_kv, padded_q, padded_kv = (_lengths(cu) for cu in offsets.values())
        for real, padded, tokens, side in ((lengths_q, padded_q, tokens_q, "q"), (lengths_kv, padded_kv, tokens_kv, "kv")):
            if any(p % (2 * size) for p in padded):
                raise ValueError(f"{name}: every padded sequence length must be a multiple of 2 * cp_size = {2 * size} "
                                 f"(each rank holds 2 of its chunks), got cu_seqlens_{side}_padded lengths {list(padded)}")
            if any(n < 0 or n > p for n, p in zip(real, padded)):
                raise ValueError(f"{name}: cu_seqlens_{side} lengths {list(real)} must lie in [0, padded length {list(padded)}]")
            if tokens * size != sum(padded):
                raise ValueError(f"{name}: this rank holds {tokens} {side} tokens; cu_seqlens_{side}_padded describes "
                                 f"{sum(padded)} over {size} ranks ({sum(padded) // size} each)")
        packed = PackedSequences(lengths_q, lengths_kv, padded_q, padded_kv, bottom_right)
        if len(_READ) >= _MAX_READ:
            _READ.popitem(last=False)
        _READ[key] = (tensors, packed)
        return packed

    def _memoized(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, made once per key: every layer's call with these offsets, and within a call q, k, v, each ring
        step and the way back, read the same index tensors and thd calls."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def tokens(self, rank: int, size: int, kv: bool, device) -> _Tokens:
        """The local tokens of ``rank``."""
        real, padded = (self.lengths_kv, self.padded_kv) if kv else (self.lengths_q, self.padded_q)
        return self._memoized(("tokens", rank, size, kv, device), lambda: _local_tokens(real, padded, rank, size, device))

    def rows(self, rank: int, size: int, kv: bool, device) -> torch.Tensor:
        """int64 [t]: the row of the whole packed batch (TE's padded layout) of each token ``rank`` of ``size`` holds."""
        def make() -> torch.Tensor:
            starts = _offsets(self.padded_kv if kv else self.padded_q, device).long()
            tokens = self.tokens(rank, size, kv=kv, device=device)
            return starts[tokens.seq] + tokens.pos

        return self._memoized(("rows", rank, size, kv, device), make)

    def natural_rows(self, size: int, kv: bool, device) -> torch.Tensor:
        """int64 [P t]: :meth:`rows` of every rank in gathered order (rank 0's tokens, then rank 1's, ...);
        ``x_gathered = x_packed[rows]``."""
        return self._memoized(("natural_rows", size, kv, device),
                              lambda: torch.cat([self.rows(rank, size, kv=kv, device=device) for rank in range(size)]))

    def natural_order(self, size: int, kv: bool, device) -> torch.Tensor:
        """int64 [P t]: the inverse permutation of :meth:`natural_rows`, ``x_packed = x_gathered[order]``."""
        return self._memoized(("natural_order", size, kv, device), lambda: self.natural_rows(size, kv=kv, device=device).argsort())

    def coarse_order(self, size: int, a2a_size: int, p2p_rank: int, kv: bool, device) -> torch.Tensor:
        """int64 [A t]: for "a2a+p2p", where the tokens of ranks p A .. p A + A - 1 (of ``size``), side by side, go to
        make the tokens of rank p of size / A: the same rows of the packed batch, in that rank's order."""
        def make() -> torch.Tensor:
            members = torch.cat([self.rows(p2p_rank * a2a_size + a, size, kv=kv, device=device) for a in range(a2a_size)])
            coarse = self.rows(p2p_rank, size // a2a_size, kv=kv, device=device)
            return members.argsort()[coarse.argsort().argsort()]

        return self._memoized(("coarse_order", size, a2a_size, p2p_rank, kv, device), make)

    def coarse_inverse(self, size: int, a2a_size: int, p2p_rank: int, device) -> torch.Tensor:
        """int64 [A t]: the inverse permutation of the queries' :meth:`coarse_order` (the way back to the members'
        tokens side by side)."""
        return self._memoized(("coarse_inverse", size, a2a_size, p2p_rank, device),
                              lambda: self.coarse_order(size, a2a_size, p2p_rank, kv=False, device=device).argsort())

    def mask_type(self, causal: bool) -> str:
        """The thd mask type of the whole batch."""
        if not causal:
            return "padding"
        return "padding_causal_bottom_right" if self.bottom_right else "padding_causal"

    def whole_call(self, causal: bool, window: Tuple[int, int], device) -> PackedCall:
        """The call over the whole packed batch (TE's padded layout, every rank's tokens)."""
        def make() -> PackedCall:
            cu_q, cu_kv, cu_q_padded, cu_kv_padded = (_offsets(lengths, device) for lengths in
                                                      (self.lengths_q, self.lengths_kv, self.padded_q, self.padded_kv))
            return PackedCall(cu_q, cu_kv, cu_q_padded, cu_kv_padded, self.mask_type(causal=causal), tuple(window))

        return self._memoized(("whole_call", causal, tuple(window), device), make)

    def chunk_call(self, rank: int, size: int, causal: bool, window: Tuple[int, int], device) -> Tuple[PackedCall, torch.Tensor]:
        """(call, key rows): ``rank``'s query chunks as sequences of their own, chunk [s, s + c) with q_n real rows
        against its sequence's keys [0, k_1) of the whole packed batch (the rows), k_1 = s + q_n causal, else the
        sequence's length; the causal mask aligned bottom-right puts query row j at position s + j.

        Raises:
            ValueError: q and kv offsets that differ (the chunks' keys are taken from the query positions).
            NotImplementedError: a window without a causal mask (its bottom-right shift differs per chunk).
        """
        if self.lengths_q != self.lengths_kv or self.padded_q != self.padded_kv:
            raise ValueError("context parallelism with cp_comm_type='all_gather' and qkv_format='thd' needs the same q and kv "
                             "offsets (self-attention); use cp_comm_type='p2p' for other offsets")
        left, right = window
        if not causal and (left, right) != (-1, -1):
            raise NotImplementedError("context parallelism with cp_comm_type='all_gather' and qkv_format='thd' supports windows "
                                      "with causal masks only; use cp_comm_type='p2p' for other windows")

        def make() -> Tuple[PackedCall, torch.Tensor]:
            q_real, q_padded, kv_lengths, kv_starts, start = [], [], [], [], 0
            for n, lp in zip(self.lengths_q, self.padded_q):
                c = lp // (2 * size)
                for chunk in (rank, 2 * size - 1 - rank):
                    q_n = min(max(n - chunk * c, 0), c)
                    q_real.append(q_n)
                    q_padded.append(c)
                    kv_lengths.append(0 if q_n == 0 else (chunk * c + q_n if causal else n))
                    kv_starts.append(start)
                start += lp
            counts = torch.tensor(kv_lengths, dtype=torch.int64)
            rows = torch.repeat_interleave(torch.tensor(kv_starts, dtype=torch.int64), counts) + _positions_within(counts)
            cu_kv = _offsets(kv_lengths, device)
            mask_type, call_window = ("padding_causal_bottom_right", (left, 0)) if causal else ("padding", (-1, -1))
            return PackedCall(_offsets(q_real, device), cu_kv, _offsets(q_padded, device), cu_kv, mask_type, call_window), rows.to(device)

        return self._memoized(("chunk_call", rank, size, causal, (left, right), device), make)


def _offsets(lengths, device) -> torch.Tensor:
    """int32 [b + 1] offsets of sequences of ``lengths``."""
    return torch.tensor((0,) + tuple(lengths), dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def _lengths(cu: torch.Tensor) -> Tuple[int, ...]:
    values: List[int] = cu.tolist()
    return tuple(b - a for a, b in zip(values[:-1], values[1:]))


def _local_tokens(real: Tuple[int, ...], padded: Tuple[int, ...], rank: int, size: int, device) -> _Tokens:
    """Sequence, position and real length of each token rank ``rank`` holds: per sequence, chunks rank and 2P-1-rank.

    Example (one sequence of padded length 8, 6 real tokens, P = 2, rank 0): positions [0, 1, 6, 7].
    """
    chunk = torch.tensor(padded, dtype=torch.int64) // (2 * size)
    seq = torch.repeat_interleave(torch.arange(len(padded)), 2 * chunk)
    j = _positions_within(2 * chunk)  # the token's index among its sequence's local tokens
    c = chunk[seq]
    pos = torch.where(j < c, rank * c + j, (2 * size - 1 - rank) * c + j - c)
    return _Tokens(seq.to(device), pos.to(device), torch.tensor(real, dtype=torch.int64)[seq].to(device))


def _positions_within(counts: torch.Tensor) -> torch.Tensor:
    """int64 [sum counts]: 0 .. counts[i] - 1 for each i in turn.

    Example:
        >>> _positions_within(torch.tensor([2, 0, 3])).tolist()
        [0, 1, 0, 1, 2]
    """
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(int(counts.sum())) - torch.repeat_interleave(starts, counts)


def packed_hidden(packed: PackedSequences, rank: int, src: int, size: int, causal: bool, window_size: Tuple[int, int],
                  device) -> torch.Tensor:
    """bool [t_q, t_kv]: True where the block of ``rank``'s queries and ``src``'s keys hides a key (see the module docstring)."""
    q, k = packed.tokens(rank, size, kv=False, device=device), packed.tokens(src, size, kv=True, device=device)
    hidden = (q.seq[:, None] != k.seq[None, :]) | (k.pos >= k.length)[None, :] | (q.pos >= q.length)[:, None]
    offset = k.pos[None, :] - q.pos[:, None]
    if packed.bottom_right:
        offset = offset - (k.length[None, :] - q.length[:, None])
    left, right = window_size
    right = 0 if causal else right
    if right >= 0:
        hidden |= offset > right
    if left >= 0:
        hidden |= offset < -left
    return hidden
