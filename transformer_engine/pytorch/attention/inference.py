"""KV caching for incremental decoding: ``InferenceParams`` and its cache managers.

One decoding iteration::

    inference_params.pre_step(OrderedDict(zip(seq_ids, step_lens)))   # which sequences, how many new tokens
    out = model(new_tokens, inference_params=inference_params, ...)    # each attention layer calls step()

``pre_step`` advances the tracked sequences: a sequence id already in the cache grows by its step
length, an id missing from ``step_dict`` is finished and dropped, a new id starts with its step
length (its prompt). The batch order of the model's inputs is the order of ``sequences``: the
unfinished sequences in their previous order, then the new ones. ``step(layer, new_k, new_v)`` (run by
``DotProductAttention``) writes the new tokens of one layer at positions [pre_len, pre_len + step_len)
of each sequence and returns that layer's keys / values as padded "bshd" [b, max_seqlen, h_kv, d]
with the offsets ``cu_seqlens_q`` (new tokens) and ``cu_seqlens_kv`` (cached tokens, new included).

The non-paged cache keeps row i for the i-th sequence (rows are reordered when sequences finish);
the paged cache keeps ``total_num_pages`` pages of ``page_size`` tokens and a page table per sequence.
Cache tensors live on the current GPU (the CPU without one) and follow the inputs' device.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Dict, List, Optional, Tuple

import torch

from ..module.base import default_device
from . import _layout

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"]


def _cu(lengths: List[int], size: int) -> torch.Tensor:
    """int32 offsets [size + 1] of ``lengths``, the tail repeating the total (TE's fixed-size buffers)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets + [offsets[-1]] * (size - len(lengths)), dtype=torch.int32)


def _new_tokens(new: torch.Tensor, cu_new: torch.Tensor, qkv_format: str) -> torch.Tensor:
    """The new tokens of every sequence, packed [t, h, d], from a bshd / sbhd / thd tensor."""
    if qkv_format == "thd":
        return new[: int(cu_new[-1])]
    return _layout.pack_bshd(_layout.to_bshd(new, qkv_format), cu_new)


def _token_slots(cu_new: torch.Tensor, cu_cached: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position) of every new token: position = cached length before the step + l."""
    new_lens, cached_lens = _layout.seqlens(cu_new), _layout.seqlens(cu_cached)
    starts = cached_lens - new_lens
    rows = _layout.token_rows(cu_new, torch.zeros_like(new_lens))
    seq = torch.repeat_interleave(torch.arange(new_lens.numel(), device=new_lens.device), new_lens, output_size=rows.numel())
    return seq.to(device), (starts[seq] + rows).to(device)


class KVCacheManager:
    """Base class of the cache managers (TE's interface, for ``custom_cache_manager``).

    Attributes:
        cache: layer number -> (k_cache, v_cache).
        sequences: sequence id -> cached length (new tokens included), in batch order.
    """

    def __init__(self):
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.sequences: "OrderedDict[int, int]" = OrderedDict()

    def reset(self) -> None:
        """Forget every sequence (the cache tensors are kept)."""
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int) -> None:
        """Create the cache tensors of one layer."""
        raise NotImplementedError

    def pre_step(self, step_dict: "OrderedDict[int, int]") -> "OrderedDict[int, int]":
        """Advance, drop and add sequences for one iteration; returns ``sequences``."""
        raise NotImplementedError

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        """Write one layer's new tokens; returns that layer's (k_cache, v_cache)."""
        raise NotImplementedError

    def _tensors(self, layer_number: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache, moved once to ``device`` if the inputs live elsewhere."""
        if layer_number not in self.cache:
            raise KeyError(f"layer {layer_number} has no KV cache; call allocate_memory({layer_number}) first")
        k, v = self.cache[layer_number]
        if k.device != device:
            k, v = k.to(device), v.to(device)
            self.cache[layer_number] = (k, v)
        return k, v


def _advance(sequences: "OrderedDict[int, int]", step_dict: "OrderedDict[int, int]") -> List[int]:
    """Grow unfinished sequences, drop finished ones, append new ones; returns the finished ids."""
    finished = [s for s in sequences if s not in step_dict]
    for seq in finished:
        sequences.pop(seq)
    for seq, length in step_dict.items():
        sequences[seq] = sequences.get(seq, 0) + int(length)
    return finished


class NonPagedKVCacheManager(KVCacheManager):
    """Row i of [max_batch_size, max_seqlen, h_kv, d] holds the i-th sequence of ``sequences``."""

    def __init__(self, max_batch_size, max_seqlen, num_heads, head_dim_k, dtype, head_dim_v=None):
        super().__init__()
        self.max_batch_size, self.max_seqlen = max_batch_size, max_seqlen
        self.num_heads, self.dtype = num_heads, dtype
        self.head_dim_k = head_dim_k
        self.head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self._order: Optional[torch.Tensor] = None
        self._pending: set = set()

    def allocate_memory(self, layer_number: int) -> None:
        shape = (self.max_batch_size, self.max_seqlen, self.num_heads)
        device = default_device()
        k = torch.zeros(shape + (self.head_dim_k,), dtype=self.dtype, device=device)
        v = torch.zeros(shape + (self.head_dim_v,), dtype=self.dtype, device=device)
        self.cache[layer_number] = (k, v)

    def pre_step(self, step_dict):
        previous = list(self.sequences)
        kept = [i for i, seq in enumerate(previous) if seq in step_dict]
        order = kept + [i for i in range(self.max_batch_size) if i not in kept]
        _advance(self.sequences, step_dict)
        if len(self.sequences) > self.max_batch_size:
            raise ValueError(f"{len(self.sequences)} sequences exceed max_batch_size={self.max_batch_size}")
        if order != list(range(self.max_batch_size)):
            self._order, self._pending = torch.tensor(order), set(self.cache)
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        k_cache, v_cache = self._tensors(layer_number, new_k.device)
        if layer_number in self._pending:  # finished sequences left: move the kept rows to the front
            self._pending.discard(layer_number)
            k_cache.copy_(k_cache[self._order.to(k_cache.device)])
            v_cache.copy_(v_cache[self._order.to(v_cache.device)])
        batch = len(self.sequences)
        seq, pos = _token_slots(cu_new_seqlens[: batch + 1], cu_cached_seqlens[: batch + 1], new_k.device)
        if pos.numel() and int(pos.max()) >= self.max_seqlen:
            raise ValueError(f"a sequence grows past max_sequence_length={self.max_seqlen}")
        k_cache[seq, pos] = _new_tokens(new_k, cu_new_seqlens[: batch + 1], qkv_format).detach().to(k_cache.dtype)
        v_cache[seq, pos] = _new_tokens(new_v, cu_new_seqlens[: batch + 1], qkv_format).detach().to(v_cache.dtype)
        return k_cache[:batch], v_cache[:batch]


class PagedKVCacheManager(KVCacheManager):
    """Pages [total_num_pages, page_size, h_kv, d]; ``page_table[i]`` lists the pages of the i-th sequence."""

    def __init__(self, total_num_pages, page_size, num_heads, head_dim_k, dtype, max_batch_size, max_seqlen, head_dim_v=None):
        super().__init__()
        self.total_num_pages, self.page_size = total_num_pages, page_size
        self.num_heads, self.dtype = num_heads, dtype
        self.head_dim_k = head_dim_k
        self.head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.max_batch_size, self.max_seqlen = max_batch_size, max_seqlen
        self.max_pages_per_seq = max_seqlen // page_size
        self.free_pages: List[int] = list(range(total_num_pages))
        self.allocated_pages: Dict[int, List[int]] = defaultdict(list)
        self.page_table = torch.zeros(max_batch_size, self.max_pages_per_seq, dtype=torch.int32, device=default_device())

    def reset(self) -> None:
        super().reset()
        self.free_pages = list(range(self.total_num_pages))
        self.allocated_pages = defaultdict(list)
        self.page_table.zero_()

    def allocate_memory(self, layer_number: int) -> None:
        shape = (self.total_num_pages, self.page_size, self.num_heads)
        device = default_device()
        k = torch.zeros(shape + (self.head_dim_k,), dtype=self.dtype, device=device)
        v = torch.zeros(shape + (self.head_dim_v,), dtype=self.dtype, device=device)
        self.cache[layer_number] = (k, v)

    def pre_step(self, step_dict):
        for seq in _advance(self.sequences, step_dict):
            self.free_pages.extend(self.allocated_pages.pop(seq, []))
        for seq, length in self.sequences.items():
            needed = -(-length // self.page_size)
            if needed > self.max_pages_per_seq:
                raise ValueError(f"sequence {seq} grows past max_sequence_length={self.max_seqlen}")
            while len(self.allocated_pages[seq]) < needed:
                if not self.free_pages:
                    raise RuntimeError("KV cache is full: no free page left; raise total_num_pages")
                self.allocated_pages[seq].append(self.free_pages.pop(0))
        rows = [pages + [0] * (self.max_pages_per_seq - len(pages)) for pages in map(self.allocated_pages.get, self.sequences)]
        if rows:
            self.page_table[: len(rows)] = torch.tensor(rows, dtype=torch.int32)
        return self.sequences

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens, qkv_format):
        k_cache, v_cache = self._tensors(layer_number, new_k.device)
        batch = len(self.sequences)
        seq, pos = _token_slots(cu_new_seqlens[: batch + 1], cu_cached_seqlens[: batch + 1], new_k.device)
        page = self.page_table.to(new_k.device)[seq, pos // self.page_size].long()
        offset = pos % self.page_size
        k_cache[page, offset] = _new_tokens(new_k, cu_new_seqlens[: batch + 1], qkv_format).detach().to(k_cache.dtype)
        v_cache[page, offset] = _new_tokens(new_v, cu_new_seqlens[: batch + 1], qkv_format).detach().to(v_cache.dtype)
        return k_cache, v_cache

    def gather(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache as non-paged [b, max_pages_per_seq * page_size, h_kv, d] for the current batch."""
        k_cache, v_cache = self.cache[layer_number]
        table = self.page_table[: len(self.sequences)].to(k_cache.device).long()
        flat = table.reshape(-1)
        b = table.shape[0]
        return tuple(c[flat].reshape((b, -1) + tuple(c.shape[2:])) for c in (k_cache, v_cache))


class InferenceParams:
    """KV cache and sequence bookkeeping for incremental decoding (TE 2.x's ``InferenceParams``).

    Args:
        max_batch_size: most sequences decoded at once.
        max_sequence_length: longest sequence (prompt + generated tokens).
        num_heads_kv, head_dim_k, dtype: the cache's heads, key head size and dtype (required).
        head_dim_v: value head size (default head_dim_k).
        is_paged: use :class:`PagedKVCacheManager` (needs ``page_size`` and ``total_num_pages =
            max_batch_size * max_sequence_length / page_size``).
        max_ctx_len: longest prompt; required with ``qkv_format="thd"``.
        qkv_format: format of the model's q / k / v ("bshd", "sbhd" or "thd").
        custom_cache_manager: a :class:`KVCacheManager` subclass to use instead.

    Raises:
        ValueError: a missing or inconsistent argument (named in the message).

    Example:
        >>> from collections import OrderedDict
        >>> params = InferenceParams(2, 16, num_heads_kv=1, head_dim_k=4, dtype=torch.float32)
        >>> params.allocate_memory(1)
        >>> params.pre_step(OrderedDict([(0, 3), (1, 2)]))
        >>> dict(params.sequences), params.get_seqlens_pre_step().tolist()
        ({0: 3, 1: 2}, [0, 0])
    """

    def __init__(
        self,
        max_batch_size: int,
        max_sequence_length: int,
        num_heads_kv: Optional[int] = None,
        head_dim_k: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        head_dim_v: Optional[int] = None,
        is_paged: bool = False,
        total_num_pages: Optional[int] = None,
        page_size: Optional[int] = None,
        max_ctx_len: Optional[int] = None,
        qkv_format: str = "bshd",
        custom_cache_manager=None,
    ):
        if num_heads_kv is None or head_dim_k is None or dtype is None:
            raise ValueError("InferenceParams needs num_heads_kv, head_dim_k and dtype (required since TE 2.2)")
        if qkv_format not in _layout.FORMATS:
            raise ValueError(f"qkv_format={qkv_format!r} is not one of {', '.join(_layout.FORMATS)}")
        if qkv_format == "thd" and max_ctx_len is None:
            raise ValueError("max_ctx_len is required when qkv_format='thd'")
        self.max_batch_size, self.max_sequence_length = max_batch_size, max_sequence_length
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.is_paged, self.page_size, self.total_num_pages = is_paged, page_size, total_num_pages
        self.max_ctx_len = max_ctx_len
        self.cache_manager = self._make_manager(custom_cache_manager)
        self.cache_qkv_format = "bshd"
        self.input_qkv_format = qkv_format
        self.output_qkv_format = _output_format(qkv_format)
        self.reset()

    def _make_manager(self, custom) -> KVCacheManager:
        common = dict(num_heads=self.num_heads_kv, head_dim_k=self.head_dim_k, dtype=self.dtype, head_dim_v=self.head_dim_v)
        if not self.is_paged:
            cls = custom or NonPagedKVCacheManager
            return cls(max_batch_size=self.max_batch_size, max_seqlen=self.max_sequence_length, **common)
        if self.page_size is None or self.max_sequence_length % self.page_size:
            raise ValueError(f"a paged cache needs page_size dividing max_sequence_length={self.max_sequence_length}")
        pages_per_seq = self.max_sequence_length // self.page_size
        if self.total_num_pages != self.max_batch_size * pages_per_seq:
            raise ValueError(
                f"total_num_pages={self.total_num_pages} must equal max_batch_size * max_sequence_length / "
                f"page_size = {self.max_batch_size * pages_per_seq}"
            )
        cls = custom or PagedKVCacheManager
        return cls(total_num_pages=self.total_num_pages, page_size=self.page_size, max_batch_size=self.max_batch_size,
                   max_seqlen=self.max_sequence_length, **common)

    def reset(self) -> None:
        """Forget every sequence (start a new generation)."""
        self.cache_manager.reset()
        self.sequences: "OrderedDict[int, int]" = OrderedDict()
        self.sequences_pre_step: "OrderedDict[int, int]" = OrderedDict()
        self.batch_size = 0
        self.cu_seqlens_q = _cu([], self.max_batch_size)
        self.cu_seqlens_kv = _cu([], self.max_batch_size)
        self.pre_step_seqlens = torch.zeros(self.max_batch_size, dtype=torch.int32)

    def allocate_memory(self, layer_number: int) -> None:
        """Create the KV cache of layer ``layer_number`` (done by MultiheadAttention on first use)."""
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: "OrderedDict[int, int]") -> None:
        """Start an iteration: ``step_dict`` maps each sequence id of the batch to its new-token count."""
        self.batch_size = len(step_dict)
        self.sequences = self.cache_manager.pre_step(step_dict)
        self.sequences_pre_step = OrderedDict((s, n - int(step_dict[s])) for s, n in self.sequences.items())
        pre = list(self.sequences_pre_step.values())
        self.pre_step_seqlens = torch.tensor(pre + [0] * (self.max_batch_size - len(pre)), dtype=torch.int32)
        self.cu_seqlens_q = _cu([int(step_dict[s]) for s in self.sequences], self.max_batch_size)
        self.cu_seqlens_kv = _cu(list(self.sequences.values()), self.max_batch_size)

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """int32 [batch_size]: each sequence's cached length before this iteration (RoPE start positions)."""
        return self.pre_step_seqlens[: self.batch_size]

    def convert_paged_to_nonpaged(self, layer_number: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """A paged layer's keys / values as non-paged [b, max_sequence_length, h_kv, d]."""
        return self.cache_manager.gather(layer_number)

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor, qkv_format: str):
        """Write one layer's new keys / values into the cache and return everything attention needs.

        Returns:
            (k_cache, v_cache) as "bshd" [batch_size, S, h_kv, d] (paged caches are gathered), the
            int32 offsets cu_seqlens_q (new tokens) and cu_seqlens_kv (cached tokens) [max_batch_size + 1],
            max_sequence_length, and the output qkv format ("bshd", "sbhd_2bshd" or "thd_2bshd").
        """
        self.input_qkv_format, self.output_qkv_format = qkv_format, _output_format(qkv_format)
        device = new_k.device
        cu_q, cu_kv = self.cu_seqlens_q.to(device), self.cu_seqlens_kv.to(device)
        k_cache, v_cache = self.cache_manager.step(layer_number, new_k, new_v, cu_q, cu_kv, qkv_format)
        if self.is_paged:
            k_cache, v_cache = self.convert_paged_to_nonpaged(layer_number)
        return k_cache, v_cache, cu_q, cu_kv, self.max_sequence_length, self.output_qkv_format


def _output_format(qkv_format: str) -> str:
    return "bshd" if qkv_format == "bshd" else qkv_format + "_2bshd"
