"""Tensor-parallel parameters: the settings, the sharding of weights, and an init equal to the unsharded model's.

A "column"-parallel linear (y = x W^T) splits W [N, K] along N (dim 0): rank r holds W_r, computes
y_r = x W_r^T, a slice of y's features. A "row"-parallel linear splits W along K (dim 1): rank r
holds W_r and the matching slice x_r of the input's features and computes a partial y = sum_r x_r W_r^T
(the all-reduce follows, see :mod:`.linear_comm`). Column-parallel biases are split like W; row-parallel
biases are replicated.

Sharded parameters carry Megatron's attributes: ``tensor_model_parallel=True``, ``partition_dim``
(0 column, 1 row) and ``partition_stride`` s. The partitioned dimension of the full tensor is read as
s * P equal chunks and rank r holds chunks r, r + P, ..., r + (s - 1) P: s = 1 is a contiguous
block; s = 2 is a gated FC1 [a; b] whose rank holds [a_r; b_r]. Sections of unequal sizes (a fused
[Q; K; V] projection with fewer kv heads) are named by ``partition_sections`` (full sizes, see
:func:`set_partition_sections`): rank r holds the r-th of P chunks of each section, [Q_r; K_r; V_r].

Initialization equal to the unsharded model's: when the group is known, each sharded parameter is
initialized at its full size (drawing exactly the random numbers the unsharded model draws, inside
the module's ``get_rng_state_tracker`` fork if any) and the rank keeps its shard. So with the same seed
on every rank, the sharded model holds the shards of the single-process model's weights. Without a
group yet (``tp_size > 1``, ``tp_group=None``), the shard is initialized on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from .comm import all_gather, all_reduce, group_rank, group_size

__all__ = [
    "PARALLEL_MODES",
    "ParallelConfig",
    "full_tensor",
    "initialize",
    "local_features",
    "megatron_attributes",
    "resolve_tp_size",
    "set_partition_sections",
    "set_tensor_parallel_group",
    "shard",
    "shard_state_dict",
    "sum_grads_over_group",
]

PARALLEL_MODES = (None, "column", "row")


def resolve_tp_size(tp_group: Any, tp_size: int) -> int:
    """The tensor-parallel size: the group's size when a group is given (TE's rule), else ``tp_size``.

    Raises:
        ValueError: ``tp_size`` is not an int >= 1, or it disagrees with the group's size.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    if tp_group is None:
        return tp_size
    size = group_size(tp_group)
    if tp_size not in (1, size):
        raise ValueError(f"tp_size={tp_size} disagrees with tp_group, which has {size} ranks; pass tp_size={size} or leave it out")
    return size


@dataclass(frozen=True)
class ParallelConfig:
    """A module's tensor-parallel and communication-overlap settings, checked once.

    Attributes:
        tp_group: the tensor-parallel process group (None until :meth:`with_group` for tp_size > 1).
        tp_size: P; with a group, the group's size.
        sequence_parallel: the input (column-parallel) or output (row-parallel) is sharded along dim 0;
            only honoured when P > 1.
        parallel_mode: None, "column" or "row" (Linear, LayerNormLinear).
        symmetric_ar_type: stored (TE's symmetric all-reduce option).
        comm_overlap: the names of the ``ub_*`` options that were switched on (``ub_overlap_ag``,
            ``ub_overlap_rs``, ``ub_overlap_rs_dgrad`` and ``ub_bulk_wgrad`` act, see
            :func:`..parallel.linear_comm.linear_comm`).
        ub_name: stored.

    Raises:
        ValueError: a ``parallel_mode`` other than None / "column" / "row", or a bad ``tp_size``.

    Example:
        >>> config = ParallelConfig(tp_size=2, sequence_parallel=True, parallel_mode="column")
        >>> config.tp_size, config.tp_group is None
        (2, True)
    """

    tp_group: Any = None
    tp_size: int = 1
    sequence_parallel: bool = False
    parallel_mode: Optional[str] = None
    symmetric_ar_type: Optional[str] = None
    comm_overlap: Tuple[str, ...] = ()
    ub_name: Optional[str] = None

    def __post_init__(self):
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"parallel_mode={self.parallel_mode!r} is not supported; use None, 'column' or 'row'")
        object.__setattr__(self, "tp_size", resolve_tp_size(self.tp_group, self.tp_size))

    @staticmethod
    def switched_on(**ub_flags) -> Tuple[str, ...]:
        """The names of the ``ub_*`` flags that are True."""
        return tuple(name for name, on in ub_flags.items() if on)

    def with_group(self, tp_group: Any) -> "ParallelConfig":
        """The same settings over ``tp_group`` (TE's ``set_tensor_parallel_group``); a module built with
        tp_size 1 is not split and has nothing to communicate, so it stays as it is.

        Raises:
            ValueError: the group's size differs from the ``tp_size`` (> 1) the parameters were split for.
        """
        if self.tp_size == 1:
            return self
        size = group_size(tp_group) if tp_group is not None else self.tp_size
        if size != self.tp_size:
            raise ValueError(
                f"set_tensor_parallel_group: the group has {size} ranks but the module was built with tp_size={self.tp_size}; "
                f"build it with tp_size={size}"
            )
        return ParallelConfig(tp_group, self.tp_size, self.sequence_parallel, self.parallel_mode, self.symmetric_ar_type,
                              self.comm_overlap, self.ub_name)


def set_tensor_parallel_group(root: torch.nn.Module, tp_group: Any) -> None:
    """TE's ``set_tensor_parallel_group`` of a composite module (MultiheadAttention, TransformerLayer):
    every module inside that has a tensor-parallel group, ``root`` included, gets ``tp_group``."""
    for module in root.modules():
        config = getattr(module, "parallel", None)
        if isinstance(config, ParallelConfig):
            module.parallel = config.with_group(tp_group)
        elif hasattr(module, "tp_group"):
            module.tp_group = tp_group


def sum_grads_over_group(module: torch.nn.Module, get_group: Callable[[], Any]) -> None:
    """Make the gradients of ``module``'s parameters sums over the tensor-parallel group ``get_group()``.

    For parameters replicated on every rank but applied to 1/P of the work, e.g. a q/k norm shared by
    the attention heads, of which each rank holds 1/P: each rank's gradient is a partial sum. The group
    is read in backward (it may be set after construction).
    """
    for param in module.parameters():
        param.register_hook(lambda grad: all_reduce(grad, get_group()))


def local_features(in_features: int, out_features: int, parallel_mode: Optional[str], tp_size: int,
                   partition_stride: int = 1) -> Tuple[int, int]:
    """This rank's (in, out) features: "column" divides out by P, "row" divides in.

    Raises:
        ValueError: an unknown ``parallel_mode``, or a split size not divisible by P (times the stride).

    Example:
        >>> local_features(32, 16, "column", 2), local_features(32, 16, "row", 2)
        ((32, 8), (16, 16))
    """
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode={parallel_mode!r} is not supported; use None, 'column' or 'row'")
    if parallel_mode is None:
        return in_features, out_features
    name, divided = ("out_features", out_features) if parallel_mode == "column" else ("in_features", in_features)
    if divided % (tp_size * partition_stride):
        parts = f"tp_size={tp_size}" + (f" x {partition_stride} (gated halves)" if partition_stride > 1 else "")
        raise ValueError(
            f"{parallel_mode}-parallel linear: {name}={divided} is not divisible by {parts}; "
            f"pick sizes that divide by {tp_size * partition_stride}"
        )
    if parallel_mode == "column":
        return in_features, out_features // tp_size
    return in_features // tp_size, out_features


def megatron_attributes(parallel_mode: Optional[str], partition_stride: int = 1) -> Dict[str, Any]:
    """The attributes of a parameter split by ``parallel_mode`` (none when it is not split)."""
    if parallel_mode is None:
        return {}
    return {"tensor_model_parallel": True, "partition_dim": 0 if parallel_mode == "column" else 1,
            "partition_stride": partition_stride}


def _is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def set_partition_sections(param: torch.Tensor, sections: Sequence[int], tp_size: int) -> None:
    """Mark a column-sharded ``param`` as the sections ``sections`` (full sizes along dim 0) side by side,
    each sharded on its own: rank r holds [S0_r; S1_r; ...] (``partition_stride`` = len(sections)).

    Raises:
        ValueError: a section not divisible by ``tp_size``, or sections that do not sum to the full size.
    """
    sections = tuple(int(s) for s in sections)
    if any(s % tp_size for s in sections) or sum(sections) != param.shape[0] * tp_size:
        raise ValueError(
            f"partition sections {sections} must each divide by tp_size={tp_size} and sum to the full size "
            f"{param.shape[0] * tp_size}"
        )
    param.partition_stride, param.partition_sections = len(sections), sections


def _layout(param: torch.Tensor) -> Tuple[int, int, Optional[Tuple[int, ...]]]:
    """(partition_dim, partition_stride, partition_sections or None) of a sharded parameter."""
    return param.partition_dim, getattr(param, "partition_stride", 1), getattr(param, "partition_sections", None)


def shard(full: torch.Tensor, partition_dim: int, partition_stride: int, rank: int, tp_size: int,
          sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full``: chunks rank, rank + P, ... of its s * P chunks along ``partition_dim``,
    or with ``sections`` the rank's chunk of each section.

    Example:
        >>> full = torch.arange(8).reshape(4, 2)          # rows [a0; a1; b0; b1]
        >>> shard(full, 0, 1, rank=1, tp_size=2).tolist()  # a contiguous block
        [[4, 5], [6, 7]]
        >>> shard(full, 0, 2, rank=1, tp_size=2).tolist()  # gated [a; b]: rank 1 holds [a1; b1]
        [[2, 3], [6, 7]]
        >>> shard(torch.arange(8), 0, 2, rank=1, tp_size=2, sections=(4, 4)).tolist()
        [2, 3, 6, 7]
    """
    if sections is not None:
        pieces = full.split(list(sections), dim=partition_dim)
        return torch.cat([p.chunk(tp_size, dim=partition_dim)[rank] for p in pieces], dim=partition_dim)
    chunks = full.chunk(partition_stride * tp_size, dim=partition_dim)
    return torch.cat(chunks[rank::tp_size], dim=partition_dim)


def _assemble(shards, partition_dim: int, partition_stride: int, sections: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of :func:`shard`)."""
    if sections is not None:
        local = [s // len(shards) for s in sections]
        pieces = [s.split(local, dim=partition_dim) for s in shards]
    else:
        pieces = [s.chunk(partition_stride, dim=partition_dim) for s in shards]
    return torch.cat([p[i] for i in range(len(pieces[0])) for p in pieces], dim=partition_dim)


def initialize(param: torch.Tensor, init_fn: Callable[[torch.Tensor], None], config: ParallelConfig) -> None:
    """Run ``init_fn`` on ``param``; a sharded parameter gets its shard of a full-size initialization."""
    if not _is_sharded(param) or config.tp_size == 1 or config.tp_group is None:
        init_fn(param)
        return
    dim, stride, sections = _layout(param)
    shape = list(param.shape)
    shape[dim] *= config.tp_size
    full = torch.empty(shape, dtype=param.dtype, device=param.device)
    init_fn(full)
    param.copy_(shard(full, dim, stride, group_rank(config.tp_group), config.tp_size, sections))


def full_tensor(local: torch.Tensor, like: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """The unsharded value of ``local`` (a parameter, or a tensor shaped like parameter ``like``, e.g. its grad).

    Replicated parameters come back as they are; sharded ones are gathered from every rank of ``tp_group``
    (a collective: every rank must call it).
    """
    if not _is_sharded(like) or group_size(tp_group) == 1:
        return local
    dim, stride, sections = _layout(like)
    gathered = all_gather(local.detach().movedim(dim, 0).contiguous(), tp_group)
    shards = [s.movedim(0, dim) for s in gathered.chunk(group_size(tp_group), dim=0)]
    return _assemble(shards, dim, stride, sections)


def shard_state_dict(module: torch.nn.Module, full_state_dict: Mapping[str, Any], tp_group: Any) -> Dict[str, Any]:
    """This rank's state dict from an unsharded (single-process) one, for ``module.load_state_dict``.

    Entries of sharded parameters are cut to this rank's shard; everything else is passed through.

    Example:
        >>> import transformer_engine.pytorch as te
        >>> layer = te.Linear(8, 4)
        >>> sorted(shard_state_dict(layer, layer.state_dict(), None))
        ['_extra_state', 'bias', 'weight']
    """
    params = dict(module.named_parameters())
    rank, size = group_rank(tp_group), group_size(tp_group)
    out = dict(full_state_dict)
    for name, value in full_state_dict.items():
        param = params.get(name)
        if param is not None and _is_sharded(param) and size > 1:
            dim, stride, sections = _layout(param)
            out[name] = shard(value, dim, stride, rank, size, sections)
    return out
