"""Beyond one GPU: tensor and sequence parallelism, and distributed checkpoints, through ``torch.distributed``.

- :mod:`.comm`: the collectives (all-reduce, all-gather, reduce-scatter, FP8 gather) and their
  autograd-aware ``*_region`` wrappers;
- :mod:`.tensor_parallel`: the modules' parallel settings, sharded parameters (Megatron attributes),
  an initialization equal to the unsharded model's, sharding / gathering of full tensors;
- :mod:`.linear_comm`: the communication of one linear at the marked points of the modules' Functions;
- :mod:`.dcp`: a ``torch.distributed.checkpoint`` load planner for ``_extra_state`` (imported on first
  use: ``torch.distributed.checkpoint`` takes over a second to import).

Data parallelism (``DistributedDataParallel``, FSDP2's ``fully_shard``) needs nothing from here: the
modules are plain ``nn.Module``s whose FP8 scales agree across ranks through the amax reduction of
``autocast(amax_reduction_group=...)``.
"""

from .comm import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .linear_comm import NO_COMM, LinearComm, linear_comm
from .tensor_parallel import ParallelConfig, full_tensor, shard_state_dict

__all__ = [
    "ExtraStateLoadPlanner",
    "LinearComm",
    "NO_COMM",
    "ParallelConfig",
    "copy_to_tensor_parallel_region",
    "full_tensor",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "linear_comm",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "shard_state_dict",
]


def __getattr__(name: str):
    if name == "ExtraStateLoadPlanner":
        from .dcp import ExtraStateLoadPlanner

        return ExtraStateLoadPlanner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
