"""The communication of one tensor-parallel linear, called at the marked points of the modules' autograd Functions.

A module's Function calls every method below at a fixed place; with no tensor parallelism
(:data:`NO_COMM`) each returns its argument, so the Functions read the same in every mode:

    forward                                         backward
    x_op = comm.gather_input(quantize(x))           dy_op = comm.gather_grad_output(quantize(dy))
    y, x_op = comm.forward_gemm(x_op, fprop, ...)   dx, dy_op = comm.dgrad_gemm(dy_op, dgrad, ...)
      (y = comm.reduce_output(                        (dx = comm.reduce_grad_input(dgrad(dy_op)))
           fprop(x_op, W, comm.gemm_bias(b)), b))   dW, db = wgrad, bgrad
                                                    db = comm.reduce_bias_grad(db)
                                                    dgamma, dbeta = comm.reduce_norm_grads(...)

What each point does, over the tensor-parallel group of P ranks (rows = dim 0 = the sequence):

| point | column-parallel | column + sequence parallel | row-parallel | row + sequence parallel |
|---|---|---|---|---|
| gather_input | - | all-gather rows (FP8 payload under FP8) | - | - |
| gemm_bias | b | b | None (added after the reduction) | None |
| reduce_output | - | - | all-reduce, + b | reduce-scatter rows, + b |
| gather_grad_output | - | - | - | all-gather rows (FP8 payload) |
| reduce_grad_input | all-reduce | reduce-scatter rows | - | - |
| reduce_bias_grad | - | - | - | all-reduce (each rank summed its rows) |
| reduce_norm_grads | - | all-reduce (the norm ran on the rank's rows) | - | - |
| deferred_bias (``return_bias``) | - | - | - | gradient all-reduced |

Tensors gathered in FP8 are cast with a scale every rank shares (:meth:`adapt`): delayed scaling's
scales agree once the amaxes are MAX-reduced; current scaling MAX-reduces each shard's amax first.

Under sequence parallelism the collectives can be pipelined with the GEMMs next to them
(:mod:`.overlap`): TE's ``ub_overlap_ag`` for the all-gathers (column-parallel input before the fprop,
row-parallel dy before the dgrad), ``ub_overlap_rs`` for the row-parallel output reduce-scatter after
the fprop, ``ub_overlap_rs_dgrad`` (or ``ub_bulk_wgrad``) for the column-parallel dx reduce-scatter
after the dgrad. A gathered tensor's cast then covers this rank's rows only; :meth:`forward_gemm` /
:meth:`dgrad_gemm` gather it block by block while the GEMM consumes the blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, Tuple

import torch

from .comm import all_gather, all_reduce_, all_reduce_max, copy_to_tensor_parallel_region, group_size, reduce_scatter
from .overlap import BlockGemm, all_gather_gemm, gemm_reduce_scatter, splits_by_rows
from .tensor_parallel import ParallelConfig

__all__ = ["LinearComm", "NO_COMM", "linear_comm", "share_scales"]


@dataclass(frozen=True)
class LinearComm:
    """The collectives of one linear (see the module docstring); mode None = no communication.

    Attributes:
        group: the tensor-parallel process group.
        mode: "column", "row" or None.
        sequence_parallel: rows of the input (column) or output (row) are sharded over the group.
        overlap_ag: column + SP: pipeline the input's all-gather with the fprop (``ub_overlap_ag``).
        overlap_rs: row + SP: pipeline the fprop with the output's reduce-scatter (``ub_overlap_rs``).
        overlap_rs_dgrad: column + SP: pipeline the dgrad with the reduce-scatter of dx (``ub_overlap_rs_dgrad``,
            or ``ub_bulk_wgrad``: TE hides that reduce-scatter under the wgrad GEMM instead).
        (``overlap_ag`` also pipelines the row + SP backward: dy's all-gather with the dgrad, as TE's flag does.)
    """

    group: Any = None
    mode: Optional[str] = None
    sequence_parallel: bool = False
    overlap_ag: bool = False
    overlap_rs: bool = False
    overlap_rs_dgrad: bool = False

    @property
    def _column(self) -> bool:
        return self.mode == "column"

    @property
    def _row(self) -> bool:
        return self.mode == "row"

    # --------------------------------------------------------------------------------- forward
    def adapt(self, gemm):
        """The GEMM's quantizers (a ``GemmQuantizers``), with a shared scale for the tensor this linear gathers in FP8."""
        if not self.sequence_parallel:
            return gemm
        reduce_amax = partial(all_reduce_max, group=self.group)
        if self._column:
            return dataclasses.replace(gemm, input=gemm.input.for_sharded_tensor(reduce_amax))
        return dataclasses.replace(gemm, grad_output=gemm.grad_output.for_sharded_tensor(reduce_amax))

    @property
    def gathers_input(self) -> bool:
        """True when :meth:`gather_input` all-gathers (column + SP): a transpose is made after the gather."""
        return self._column and self.sequence_parallel

    def gather_input(self, x_op):
        """Column + SP: the rows of every rank (the GEMM input); else ``x_op``."""
        return all_gather(x_op, self.group) if self.gathers_input else x_op

    def pipelines_gather(self, quantizer) -> bool:
        """True when :meth:`forward_gemm` all-gathers the input (``overlap_ag``, and a ``quantizer`` whose
        casts can be gathered): its cast then covers this rank's rows, without transpose, and is not gathered first."""
        return self.gathers_input and self.overlap_ag and quantizer.gathers_quantized

    def for_cast(self, quantizer) -> "LinearComm":
        """This communication as the input's cast sees it: none when :meth:`forward_gemm` does the gather."""
        return NO_COMM if self.pipelines_gather(quantizer) else self

    def forward_gemm(self, x_op, gemm: BlockGemm, n: int, dtype: torch.dtype, bias: Optional[torch.Tensor],
                     gather: bool) -> Tuple[torch.Tensor, Any]:
        """(y, the GEMM input as gathered): y = gemm(x_op) [M, n] with the forward communication.

        ``gemm(a, out[, bias])`` computes the fprop of operand rows ``a`` (into ``out`` when given), with
        :meth:`gemm_bias` or ``bias``. ``gather`` (see :meth:`pipelines_gather`): ``x_op`` holds this rank's rows and is
        all-gathered block by block under the GEMM; row + SP with ``overlap_rs``: the output is
        reduce-scattered block by block; otherwise ``y = reduce_output(gemm(x_op), bias)``.
        """
        scatter = self._row and self.sequence_parallel and self.overlap_rs
        return self._pipelined(x_op, gemm, n, dtype, gather, scatter, bias, self.reduce_output)

    def _pipelined(self, a, gemm: BlockGemm, n: int, dtype: torch.dtype, gather: bool, scatter: bool,
                   bias: Optional[torch.Tensor], reduce) -> Tuple[torch.Tensor, Any]:
        """(y, a as gathered): the GEMM of ``a`` with its input gathered (``gather``) or its output
        reduce-scattered (``scatter``) block by block, else ``reduce(gemm(a), bias)``."""
        if gather:
            y = torch.empty(a.shape[0] * group_size(self.group), n, dtype=dtype, device=a.device)
            return y, all_gather_gemm(a, gemm, y, self.group)
        if scatter and splits_by_rows(a):
            return gemm_reduce_scatter(a, gemm, n, dtype, self.group, bias), a
        return reduce(gemm(a, None), bias), a

    def gemm_bias(self, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The bias the GEMM adds: none for row-parallel (it is added once, after the reduction)."""
        return None if self._row else bias

    def reduce_output(self, y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Row-parallel: sum the partial outputs (all-reduce, or reduce-scatter rows under SP), then + bias."""
        if not self._row:
            return y
        y = reduce_scatter(y, self.group) if self.sequence_parallel else all_reduce_(y.contiguous(), self.group)
        return y if bias is None else y + bias

    def deferred_bias(self, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The bias returned by ``return_bias``; row + SP: its gradient is all-reduced (the caller adds it to the rank's rows)."""
        if bias is None or not (self._row and self.sequence_parallel):
            return bias
        return copy_to_tensor_parallel_region(bias, self.group)

    # -------------------------------------------------------------------------------- backward
    @property
    def gathers_grad_output(self) -> bool:
        """True when :meth:`gather_grad_output` all-gathers (row + SP)."""
        return self._row and self.sequence_parallel

    def gather_grad_output(self, dy_op):
        """Row + SP: the rows of every rank of dy; else ``dy_op``."""
        return all_gather(dy_op, self.group) if self.gathers_grad_output else dy_op

    def pipelines_grad_gather(self, quantizer) -> bool:
        """True when :meth:`dgrad_gemm` all-gathers dy (row + SP with ``overlap_ag``, a ``quantizer`` whose
        casts can be gathered): dy's cast then covers this rank's rows, without transpose."""
        return self.gathers_grad_output and self.overlap_ag and quantizer.gathers_quantized

    def for_grad_cast(self, quantizer) -> "LinearComm":
        """This communication as dy's cast sees it: none when :meth:`dgrad_gemm` does the gather."""
        return NO_COMM if self.pipelines_grad_gather(quantizer) else self

    @property
    def pipelines_dgrad(self) -> bool:
        """True when :meth:`dgrad_gemm` communicates block by block: column + SP with ``overlap_rs_dgrad``."""
        return self._column and self.sequence_parallel and self.overlap_rs_dgrad

    def dgrad_gemm(self, dy_op, gemm: BlockGemm, k: int, dtype: torch.dtype, gather: bool) -> Tuple[torch.Tensor, Any]:
        """(dx summed over the ranks as :meth:`reduce_grad_input` sums it, dy as gathered): dx = gemm(dy_op) [M, k].

        ``gather`` (see :meth:`pipelines_grad_gather`): ``dy_op`` holds this rank's rows and is all-gathered
        block by block under the dgrad GEMM; :attr:`pipelines_dgrad`: dx is reduce-scattered block by block.
        """
        return self._pipelined(dy_op, gemm, k, dtype, gather, self.pipelines_dgrad, None,
                               lambda dx, _: self.reduce_grad_input(dx))

    def reduce_grad_input(self, dx: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Column-parallel: sum the partial dx (all-reduce, or reduce-scatter rows under SP)."""
        if dx is None or not self._column:
            return dx
        return reduce_scatter(dx, self.group) if self.sequence_parallel else all_reduce_(dx.contiguous(), self.group)

    @property
    def reduces_bias_grad(self) -> bool:
        """Row + SP: :meth:`reduce_bias_grad` sums the bias gradient over the ranks (keep it in float32 until then)."""
        return self._row and self.sequence_parallel

    def reduce_bias_grad(self, db: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Row + SP: the replicated bias's gradient summed over the ranks' rows."""
        if db is None or not self.reduces_bias_grad:
            return db
        return all_reduce_(db.contiguous(), self.group)

    def reduce_norm_grads(self, *grads: Optional[torch.Tensor]):
        """SP: the gradients of replicated norm parameters, summed over the ranks' rows (one all-reduce)."""
        if not self.sequence_parallel:
            return grads
        present = [g for g in grads if g is not None]
        if not present:
            return grads
        flat = all_reduce_(torch.cat([g.reshape(-1).float() for g in present]), self.group)
        parts = iter(flat.split([g.numel() for g in present]))
        return tuple(None if g is None else next(parts).reshape(g.shape).to(g.dtype) for g in grads)


NO_COMM = LinearComm()


def linear_comm(config: ParallelConfig, mode: Optional[str], owner: str) -> LinearComm:
    """The communication of a linear split by ``mode`` under ``config`` (:data:`NO_COMM` without TP).

    Raises:
        RuntimeError: tp_size > 1 but no group yet.

    Example:
        >>> linear_comm(ParallelConfig(), "column", "Linear") is NO_COMM
        True
    """
    if mode is None or config.tp_size == 1:
        return NO_COMM
    if config.tp_group is None:
        sp = " with sequence_parallel=True" if config.sequence_parallel else ""
        raise RuntimeError(
            f"{owner} was built with tp_size={config.tp_size}{sp} but has no tensor-parallel group; "
            "pass tp_group=... or call set_tensor_parallel_group(group) before the forward"
        )
    overlap = config.comm_overlap
    return LinearComm(config.tp_group, mode, config.sequence_parallel, "ub_overlap_ag" in overlap, "ub_overlap_rs" in overlap,
                      bool({"ub_overlap_rs_dgrad", "ub_bulk_wgrad"} & set(overlap)))


def share_scales(quantization, *comms: LinearComm):
    """``quantization`` (a ``ForwardQuantization``) with GEMM i's quantizers adapted by ``comms[i]``."""
    if all(comm is NO_COMM for comm in comms):
        return quantization
    gemms = tuple(comm.adapt(gemm) for comm, gemm in zip(comms, quantization.gemms))
    return dataclasses.replace(quantization, gemms=gemms)
