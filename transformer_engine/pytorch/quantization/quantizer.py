"""Quantizers: one object per tensor role that turns a high-precision tensor into its GEMM operand.

All quantizers share one interface, so module code never asks which recipe is active:

- ``quantize(x, columnwise=False)`` returns the operand: a :class:`Float8Tensor` (with its transpose
  written in the same pass when ``columnwise``, for the backward GEMMs), or ``x`` itself in high precision;
- ``quantize_with_dbias(x, dbias_dtype)`` casts a 2-D gradient with its transpose and also returns its
  column sums (the bias gradient, accumulated in float32, returned in ``dbias_dtype``), fused into the cast
  where the quantizer can (``fuses_dbias``: the per-tensor FP8 casts and block scaling's 1-D tiles);
- ``quantize_transposed(x)`` returns the operand of a 2-D x with only its transpose (``data_t``);
- ``quantize_weight(w)`` returns w's operand for fprop only, carrying a :class:`DeferredTranspose`
  that casts W^T again in backward (so no FP8 copy of w lives from forward to backward; modules use it
  for large weights);
- ``produce(run, columnwise=False)`` quantizes the output of a producer op that can fuse the cast (norm,
  activation); ``columnwise`` says backward reads the transposed copy (quantizers that can make it
  later from the FP8 values, such as delayed scaling's fused casts, leave it to ``transpose_only``).
  ``run(fp8_scale, fp8_dtype, amax_out)`` calls the op (passing ``amax_out`` on, see the catalog's
  ``quantize``) and returns ``(y, scale_inv, amax, extras)``; given ``(None, None, None)`` it must
  return a high-precision ``y`` (and Nones). ``produce`` returns ``(operand, extras)``.

Delayed scaling records each cast's amax into its history slot inside the cast kernel itself
(the ops' ``amax_out``): no separate max kernel, no amax buffer to zero.

The recipe picks the quantizer class:

| class | recipe | scale |
|---|---|---|
| :class:`IdentityQuantizer` | none (high precision) | - |
| :class:`Float8Quantizer` | DelayedScaling | ``state.scale[i]`` from earlier steps; amax recorded into ``amax_history[0, i]`` |
| :class:`Float8CurrentScalingQuantizer` | Float8CurrentScaling | fp8_max / amax(x) of this very tensor |
| :class:`Float8BlockQuantizer` | Float8BlockScaling | fp8_max / amax of each 1 x 128 or 128 x 128 tile |
| :class:`MXFP8Quantizer` | MXFP8BlockScaling | E8M0 2^ceil(log2(amax / fp8_max)) of each block of 32 (``ops.quantize_mxfp8``) |
| :class:`NVFP4Quantizer` | NVFP4BlockScaling | E4M3 scale of each block of 16 (or 16 x 16 tile) times a per-tensor one from amax (``ops.quantize_nvfp4``) |
| :class:`FixedScaleQuantizer` | (a weight cast again in backward) | the scale forward used (a copy once saved for backward); records no amax |
| :class:`AmaxObserver` | calibration (``autocast(calibrating=True)``) | none: records amax, stays high precision |
"""  # noqa: E501

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple, Union

import torch

from transformer_engine.common.recipe import QParams
from transformer_engine.plugin import ops
from transformer_engine.plugin.catalog.nvfp4 import check_four_over_six

from .float8_blockwise_tensor import Float8BlockwiseTensor
from .float8_tensor import DeferredTranspose, Float8Tensor
from .kept_scale import kept_copy
from .mxfp8_tensor import MXFP8Tensor
from .nvfp4_tensor import NVFP4_BLOCK, NVFP4Tensor

__all__ = [
    "AmaxObserver",
    "Float8BlockQuantizer",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "FixedScaleQuantizer",
    "IDENTITY",
    "IdentityQuantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Quantizer",
]

ProducerFn = Callable[..., Tuple]
AmaxReduction = Callable[[torch.Tensor], torch.Tensor]


class Quantizer:
    """Base class: quantize a tensor, or the output of a fusable producer (see the module docstring)."""

    #: True when ``quantize`` returns FP8 operands (the FP8 shape rules apply).
    is_fp8 = False
    #: True when shards may be quantized on each rank and then all-gathered (sequence parallelism);
    #: False when the full tensor must be gathered first (block scales and column-wise copies that
    #: span the shards), which moves high-precision bytes.
    gathers_quantized = True
    #: True when ``quantize_with_dbias`` takes the column sums in the cast's own pass over x; the base
    #: method casts and then sums, which a caller may as well do itself (in the dtype it needs).
    fuses_dbias = False
    #: True when a cast depends on the tensor alone, so casting it again later gives the same operand
    #: (False where it reads state that the step's update changes: delayed scaling's scale).
    casts_from_input_alone = True

    def quantize(self, x: torch.Tensor, columnwise: bool = False):
        """The GEMM operand for ``x``; FP8 operands of a 2-D ``x`` also carry ``data_t`` when ``columnwise``."""
        raise NotImplementedError

    def quantize_with_dbias(self, x: torch.Tensor, dbias_dtype: torch.dtype = torch.float32):
        """(operand of a 2-D x with its transpose, column sums of x accumulated in float32, in ``dbias_dtype``): a
        gradient's cast and its bias gradient."""
        sums = x.sum(dim=0, dtype=torch.float32)
        return self.quantize(x, columnwise=True), sums if dbias_dtype == torch.float32 else sums.to(dbias_dtype)

    def quantize_transposed(self, x: torch.Tensor):
        """The FP8 operand of a 2-D x keeping only ``data_t`` (what a transposed GEMM reads, e.g. W^T for dgrad)."""
        return self.quantize(x, columnwise=True).transpose_only()

    def quantize_weight(self, w: torch.Tensor):
        """w's FP8 operand for fprop (no transpose), its ``deferred_t`` casting W^T again for dgrad.

        This default casts again with this quantizer: right where the cast depends on w alone.
        """
        operand = self.quantize(w)
        operand.deferred_t = DeferredTranspose(w, self)
        return operand

    def snapshot(self) -> "Quantizer":
        """This quantizer as a cast later in the step must see it: a copy of what later updates would
        change in place (``FixedScaleQuantizer``'s scale), else self (casts that depend on the input alone)."""
        return self

    def produce(self, run: ProducerFn, columnwise: bool = False):
        """Run ``run`` in high precision, then :meth:`quantize` its output; returns (operand, extras)."""
        y, _, _, extras = run(None, None, None)
        return self.quantize(y, columnwise), extras

    def recording_into(self, amaxes: list) -> "Quantizer":
        """A quantizer that casts as this one and hands the amaxes it records to ``amaxes`` instead (delayed
        scaling, traced by torch.compile); self for quantizers that record nothing."""
        return self

    def for_recompute(self) -> "Quantizer":
        """A quantizer that casts later in the step (a recomputation in backward) as this one casts now, and
        records nothing: self where the cast depends on the input alone and records nothing."""
        return self

    def for_sharded_tensor(self, reduce_amax: AmaxReduction) -> "Quantizer":
        """A quantizer for one shard of a tensor split over ranks, casting with the scale every rank shares.

        Needed where the shards are gathered in FP8 (sequence parallelism): one scale_inv must decode
        them all. ``reduce_amax(amax)`` returns the MAX of ``amax`` over the ranks. This quantizer's scale
        does not depend on the tensor (high precision, calibration), so it is returned as is.
        """
        return self


class IdentityQuantizer(Quantizer):
    """High precision: the operand is the tensor itself."""

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> torch.Tensor:
        return x


IDENTITY = IdentityQuantizer()


class Float8Quantizer(Quantizer):
    """Delayed scaling: cast with the current ``scale[index]`` of a state and record max|x| into its history.

    q = cast_fp8(clip(x * scale[i])); amax_history[0, i] = max(amax_history[0, i], max|x|)
    (a module called twice in one step keeps the larger amax). The cast ops do the max in place
    (``amax_out``), so a cast is one launch.
    """

    is_fp8 = True
    casts_from_input_alone = False
    fuses_dbias = True

    def __init__(self, state, index: int, kept: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                 amaxes: Union[None, torch.Tensor, list] = None):
        self.state = state
        self.index = index
        self._viewed: Tuple = ()  # (state.scale, state.amax_history) the cached views below were taken of
        self._scale = self._slot = None
        #: traced forward casts only (``DelayedScalingRecipeState.traced_quantizers``): (scale, scale_inv) of
        #: this slot from the kept copy of the scale vector that one traced call's quantizers share
        self._kept = kept
        #: traced casts only, what the update of the same trace folds into the history: a float32 [N] buffer
        #: (forward) whose slot this quantizer's casts max into, or a list (backward) they append
        #: (index, amax) to; None: each cast folds its amax into H[0] itself
        self._amaxes = amaxes

    def __getstate__(self):  # copies and pickles take the state, not views of the original's tensors
        return {"state": self.state, "index": self.index}

    def __setstate__(self, saved) -> None:
        self.__init__(saved["state"], saved["index"])

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.state.fp8_dtype

    def _views(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale[i], amax_history[0, i]) as 0-d views, taken again only when the state replaced a tensor
        (history length change, ``.to(device)``): the update writes both in place. A traced call takes them
        afresh (views cost nothing in a compiled graph, and a backward traced by torch.compile may not
        change Python state), a forward cast's scale as a :func:`~.kept_scale.kept_copy` (a grad cast runs in
        the backward graph itself, before the update that rewrites its scale: nothing to keep)."""
        state = self.state
        if torch.compiler.is_compiling():  # the scale as saved for a backward that recomputes a cast (see kept_scale)
            if self._kept is not None:
                scale = self._kept[0]
            else:
                scale = state.scale[self.index]
                scale = kept_copy(scale) if state.mode == "forward" else scale
            pending = self._amaxes if isinstance(self._amaxes, torch.Tensor) else state.amax_history[0]
            return scale, pending[self.index]
        if not self._viewed or self._viewed[0] is not state.scale or self._viewed[1] is not state.amax_history:
            self._viewed = (state.scale, state.amax_history)
            self._scale, self._slot = state.scale[self.index], state.amax_history[0, self.index]
        return self._scale, self._slot

    @property
    def scale(self) -> torch.Tensor:
        """The 0-d scale this quantizer casts with."""
        return self._views()[0]

    def record(self, amax: torch.Tensor) -> None:
        """amax_history[0, i] = max(amax_history[0, i], amax)."""
        slot = self._views()[1]
        torch.maximum(slot, amax, out=slot)  # in place: one kernel

    def _recording(self, cast: Callable):
        """The result of ``cast(scale, amax_out) -> (result, amax)`` with this quantizer's scale, its amax
        max-accumulated into the history slot.

        The cast writes the slot itself (``amax_out``). Traced by torch.compile it writes no slot: the amax
        it returns goes to the backward's list (``amaxes``), or is folded by one ``maximum`` into the
        forward's amax buffer, or else into the history (no zeroed scratch slot to write first):
        AOTAutograd keeps a write into a forward input inside the backward graph only as a plain tensor
        op, not as a custom op's mutation. With kept scales, the operand's scale_inv is the kept
        reciprocal (the same values: the cast's own 1 / scale is then dead code, no kernel of its own)."""
        scale, slot = self._views()
        if not torch.compiler.is_compiling():
            return cast(scale, slot)[0]
        result, amax = cast(scale, None)
        if isinstance(self._amaxes, list):
            self._amaxes.append((self.index, amax))
        else:
            slot.copy_(torch.maximum(slot, amax))
        if self._kept is not None:
            operand = result if isinstance(result, Float8Tensor) else result[0]
            operand.scale_inv = self._kept[1]
        return result

    def recording_into(self, amaxes: list) -> "Float8Quantizer":
        """While torch.compile traces: a quantizer that casts as this one and appends (index, amax) of each
        cast to ``amaxes`` for the update of the same trace to fold in (``backward_update(amaxes)``); eager:
        self (the casts write the history slot in their own kernel)."""
        if not torch.compiler.is_compiling():
            return self
        return Float8Quantizer(self.state, self.index, self._kept, amaxes)

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> Float8Tensor:
        return self._recording(lambda scale, amax_out: _cast(x, scale, self.fp8_dtype, columnwise, amax_out))

    def quantize_weight(self, w: torch.Tensor) -> Float8Tensor:
        """The cast with this step's scale, amax recorded; W^T is cast again with that scale and records
        nothing. The update after forward changes the state's scale in place, so forward saves the
        deferred cast with a copy of it (``DeferredTranspose.snapshot``, after the GEMMs are queued)."""
        return self._recording(lambda scale, amax_out: _fixed_scale_weight(w, scale, self.fp8_dtype, amax_out))

    def quantize_with_dbias(self, x: torch.Tensor, dbias_dtype: torch.dtype = torch.float32):
        """One pass over x: FP8 x and x^T, the amax recorded, and the column sums (``ops.cast_transpose_dbias``)."""
        def cast(scale, amax_out):
            q, q_t, scale_inv, amax, dbias = ops.cast_transpose_dbias(x, scale, self.fp8_dtype, amax_out=amax_out,
                                                                      dbias_dtype=dbias_dtype)
            return (Float8Tensor(q, scale_inv, q_t), dbias), amax

        return self._recording(cast)

    def produce(self, run: ProducerFn, columnwise: bool = False):
        """Fused cast: the producer writes FP8 with this scale and records the amax of its output
        (row-major only: ``transpose_only`` makes the transpose for backward)."""
        return self._recording(lambda scale, amax_out: _produced(run, scale, self.fp8_dtype, amax_out))

    def for_recompute(self) -> "FixedScaleQuantizer":
        """Casts with a copy of this step's scale (the update at the autocast's exit changes the state's), recording nothing."""
        return FixedScaleQuantizer(self.scale.clone(), self.fp8_dtype)

    def for_sharded_tensor(self, reduce_amax: AmaxReduction) -> "Float8Quantizer":
        """Self: the scale comes from the state, the same on every rank once their amaxes are MAX-reduced.

        Raises:
            ValueError: the recipe does not reduce amaxes (``reduce_amax=False``), so the ranks' scales drift apart.
        """
        if not self.state.recipe.reduce_amax:
            raise ValueError(
                "DelayedScaling(reduce_amax=False) with sequence parallelism: the ranks gather each other's FP8 "
                "shards, which needs one scale on every rank; use reduce_amax=True (the default)"
            )
        return self


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: scale = fp8_max / max|x| of the tensor being cast (the catalog's ``scale_from_amax``)."""

    is_fp8 = True
    fuses_dbias = True

    def __init__(self, fp8_dtype: torch.dtype, qparams: QParams, reduce_amax: Optional[AmaxReduction] = None):
        self.fp8_dtype = fp8_dtype
        self.qparams = qparams
        self.reduce_amax = reduce_amax

    def _scale_and_amax(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(scale, amax): scale = fp8_max / amax, amax = max|x| (``ops.current_scale``: both in one launch
        where the backend can), MAX-reduced over the ranks first for a sharded tensor.

        The cast that follows takes this amax as its ``amax_out``: it already holds max|x|, so the cast
        leaves it as it is and needs no zeroed amax buffer of its own (a fill launch per cast). Traced by
        torch.compile the cast gets None instead (the amax is the compiler's buffer, and AOTAutograd
        cannot always functionalize one custom op writing another's output): the same values."""
        eps, power_2 = self.qparams.amax_epsilon, self.qparams.power_2_scale
        if self.reduce_amax is None:
            scale, amax = ops.current_scale(x, self.fp8_dtype, amax_epsilon=eps, power_2_scale=power_2)
        else:
            amax = self.reduce_amax(ops.compute_amax(x))
            scale = ops.scale_from_amax(amax, self.fp8_dtype, amax_epsilon=eps, power_2_scale=power_2)
        return scale, None if torch.compiler.is_compiling() else amax

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> Float8Tensor:
        scale, amax = self._scale_and_amax(x)
        return _cast(x, scale, self.fp8_dtype, columnwise, amax)[0]

    def quantize_weight(self, w: torch.Tensor) -> Float8Tensor:
        """The cast with w's scale; W^T is cast again with that scale (no second amax pass)."""
        scale, amax = self._scale_and_amax(w)
        return _fixed_scale_weight(w, scale, self.fp8_dtype, amax)[0]

    def quantize_with_dbias(self, x: torch.Tensor, dbias_dtype: torch.dtype = torch.float32):
        """FP8 x and x^T with this tensor's own scale, and the column sums, in one cast (``ops.cast_transpose_dbias``)."""
        scale, amax = self._scale_and_amax(x)
        q, q_t, scale_inv, _, dbias = ops.cast_transpose_dbias(x, scale, self.fp8_dtype, amax_out=amax, dbias_dtype=dbias_dtype)
        return Float8Tensor(q, scale_inv, q_t), dbias

    def for_sharded_tensor(self, reduce_amax: AmaxReduction) -> "Float8CurrentScalingQuantizer":
        """The same cast with scale = fp8_max / max over the ranks of each shard's amax."""
        return Float8CurrentScalingQuantizer(self.fp8_dtype, self.qparams, reduce_amax)


class Float8BlockQuantizer(Quantizer):
    """Float8BlockScaling: each tile of ``block_len`` elements (1-D, a row segment) or ``block_len``^2 (2-D)
    casts with its own scale, fp8_max / max(amax_tile, amax_epsilon), a power of two when ``qparams`` say so.

    ``columnwise`` matters more than for per-tensor casts: a 1-D cast then also writes x^T quantized
    along the tokens (``ops.cast_transpose_blockwise``), which wgrad reads and which cannot be made
    later from the row-wise copy; a 2-D cast transposes its FP8 values (a 128 x 128 tile stays one).
    """

    is_fp8 = True
    gathers_quantized = False  # a column-wise copy's blocks of 128 tokens may span the shards

    def __init__(self, fp8_dtype: torch.dtype, block_dim: int, qparams: QParams, block_len: int = 128):
        if block_dim not in (1, 2):
            raise ValueError(f"block_dim must be 1 (1 x {block_len} tiles) or 2 ({block_len} x {block_len}), got {block_dim!r}")
        self.fp8_dtype = fp8_dtype
        self.block = (1 if block_dim == 1 else block_len, block_len)
        self.qparams = qparams

    @property
    def fuses_dbias(self) -> bool:
        """1-D tiles: the cast with its transpose sums the columns on the way."""
        return self.block[0] == 1

    def quantize_with_dbias(self, x: torch.Tensor, dbias_dtype: torch.dtype = torch.float32):
        """1-D tiles: x and x^T cast and the column sums, from the same reads (``ops.cast_transpose_blockwise_dbias``)."""
        rows, block_len = self.block
        if rows != 1:  # 2-D tiles: the cast, then the sums
            return super().quantize_with_dbias(x, dbias_dtype)
        power_2, eps = self.qparams.power_2_scale, self.qparams.amax_epsilon
        q, scale_inv, q_t, scale_inv_t, dbias = ops.cast_transpose_blockwise_dbias(
            x, self.fp8_dtype, block_len=block_len, power_2_scale=power_2, amax_epsilon=eps, dbias_dtype=dbias_dtype)
        return Float8BlockwiseTensor(q, scale_inv, q_t, scale_inv_t, block=self.block), dbias

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> Float8BlockwiseTensor:
        if x.dim() != 2:
            raise ValueError(f"block scaling quantizes 2-D tensors [rows, features]; got shape {tuple(x.shape)}")
        rows, block_len = self.block
        power_2, eps = self.qparams.power_2_scale, self.qparams.amax_epsilon
        if rows == 1 and columnwise:
            q, scale_inv, q_t, scale_inv_t = ops.cast_transpose_blockwise(
                x, self.fp8_dtype, block_len=block_len, power_2_scale=power_2, amax_epsilon=eps)
            return Float8BlockwiseTensor(q, scale_inv, q_t, scale_inv_t, block=self.block)
        q, scale_inv = ops.quantize_blockwise(x, self.fp8_dtype, block_rows=rows, block_cols=block_len, power_2_scale=power_2,
                                              amax_epsilon=eps)
        operand = Float8BlockwiseTensor(q, scale_inv, block=self.block)
        return operand.with_transpose() if columnwise else operand

    def quantize_transposed(self, x: torch.Tensor) -> Float8BlockwiseTensor:
        """2-D tiles: x^T alone, its tiles read from x and stored transposed in one pass (a weight's W^T for
        dgrad; ``ops.quantize_blockwise`` of the column-major view x.t()); 1-D tiles: the cast with its transpose."""
        rows, block_len = self.block
        if rows == 1:
            return super().quantize_transposed(x)
        power_2, eps = self.qparams.power_2_scale, self.qparams.amax_epsilon
        q_t, scale_inv_t = ops.quantize_blockwise(x.t(), self.fp8_dtype, block_rows=rows, block_cols=block_len, power_2_scale=power_2,
                                                  amax_epsilon=eps)
        return Float8BlockwiseTensor(None, None, q_t, scale_inv_t, block=self.block)

    def for_sharded_tensor(self, reduce_amax: AmaxReduction) -> "Float8BlockQuantizer":
        """Self: sharded tensors are gathered in high precision and cast whole (``gathers_quantized``)."""
        return self


class MXFP8Quantizer(Quantizer):
    """MXFP8BlockScaling: each block of 32 consecutive elements casts with its own E8M0 scale
    2^ceil(log2(amax_block / fp8_max)) (``ops.quantize_mxfp8``, exact rule in plugin/catalog/mxfp8.py).

    Every copy is quantized from the high-precision tensor: ``columnwise`` also writes x^T in blocks of
    32 along the rows of x (what wgrad reads), in the same op; it needs rows % 32 == 0, the row-wise
    copy features % 32 == 0 (TE's alignment; the op raises ValueError naming the dim otherwise).
    A weight's W^T for dgrad is cast again from W in backward (``quantize_weight``: it depends on W alone).
    """

    is_fp8 = True
    gathers_quantized = False  # a column-wise block of 32 rows may span the shards

    def __init__(self, fp8_dtype: torch.dtype):
        self.fp8_dtype = fp8_dtype

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> MXFP8Tensor:
        if x.dim() != 2:
            raise ValueError(f"MXFP8 quantizes 2-D tensors [rows, features]; got shape {tuple(x.shape)}")
        return MXFP8Tensor(*ops.quantize_mxfp8(x, self.fp8_dtype, rowwise=True, columnwise=bool(columnwise)))

    def quantize_transposed(self, x: torch.Tensor) -> MXFP8Tensor:
        """x^T alone, in blocks of 32 along the rows of x (a weight's W^T for dgrad): no row-wise copy is written."""
        if x.dim() != 2:
            raise ValueError(f"MXFP8 quantizes 2-D tensors [rows, features]; got shape {tuple(x.shape)}")
        _, _, data_t, scale_inv_t = ops.quantize_mxfp8(x, self.fp8_dtype, rowwise=False, columnwise=True)
        return MXFP8Tensor(None, None, data_t, scale_inv_t)

    def for_sharded_tensor(self, reduce_amax: AmaxReduction) -> "MXFP8Quantizer":
        """Self: sharded tensors are gathered in high precision and cast whole (``gathers_quantized``)."""
        return self


class NVFP4Quantizer(Quantizer):
    """NVFP4BlockScaling: E2M1 values, an E4M3 scale per block of 16 (or per 16 x 16 tile) and a float32 amax
    per copy (``ops.quantize_nvfp4``, exact rule in plugin/catalog/nvfp4.py).

    Every copy is quantized from the high-precision tensor: ``columnwise`` also writes x^T in blocks of
    16 along the rows of x (what wgrad reads), after the random Hadamard transform when ``rht``. Stochastic
    rounding draws a fresh seed per cast from torch's generator of x's device (``torch.manual_seed``
    makes runs repeat). A weight's W^T for dgrad is cast again from W in backward (it depends on W alone).

    Args:
        rht: the random Hadamard transform on the column-wise copy (TE: inputs and gradients).
        block_2d: 16 x 16 tiles (TE: weights).
        stochastic_rounding: round to a random neighbour (TE: gradients).
        four_over_six: None, or 4over6's error mode "MAE" / "MSE": each block keeps the better of its map-to-4
            and map-to-6 candidates (TE: the non-gradient tensors ``nvfp4_4over6`` selects).
        e4m3_max: the global scale's E4M3 bound, 448, or 256 (4over6 only; TE's ``nvfp4_4over6_e4m3_use_256``).

    Raises:
        ValueError: 4over6 with ``rht`` or ``stochastic_rounding`` (TE refuses both), another error mode or bound,
            or the bound 256 without 4over6.
    """

    is_fp8 = True
    gathers_quantized = False  # a column-wise block of 16 rows may span the shards

    def __init__(self, *, rht: bool = False, block_2d: bool = False, stochastic_rounding: bool = False,
                 four_over_six: Optional[str] = None, e4m3_max: int = 448):
        check_four_over_six(four_over_six, e4m3_max, rht=rht, stochastic_rounding=stochastic_rounding)
        self.rht, self.block_2d, self.stochastic_rounding = rht, block_2d, stochastic_rounding
        self.four_over_six, self.e4m3_max = four_over_six, e4m3_max
        self.block = (NVFP4_BLOCK if block_2d else 1, NVFP4_BLOCK)
        self.casts_from_input_alone = not stochastic_rounding  # (each stochastic cast draws a new seed)

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> NVFP4Tensor:
        if x.dim() != 2:
            raise ValueError(f"NVFP4 quantizes 2-D tensors [rows, features]; got shape {tuple(x.shape)}")
        rht = self.rht and columnwise
        seed = _random_seed(x.device) if self.stochastic_rounding else None
        data, scale, amax, data_t, scale_t, amax_t = ops.quantize_nvfp4(
            x, rowwise=rowwise, columnwise=columnwise, block_2d=self.block_2d, rht=rht, stochastic_rounding=self.stochastic_rounding,
            seed=seed, four_over_six=self.four_over_six, e4m3_max=self.e4m3_max,
        )
        return NVFP4Tensor(data, scale, amax, data_t, scale_t, amax_t, rht_t=rht, block=self.block, e4m3_max=self.e4m3_max)

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> NVFP4Tensor:
        return self._cast(x, rowwise=True, columnwise=bool(columnwise))

    def quantize_transposed(self, x: torch.Tensor) -> NVFP4Tensor:
        """x^T alone, in blocks of 16 along the rows of x (a weight's W^T for dgrad): no row-wise copy is written."""
        return self._cast(x, rowwise=False, columnwise=True)

    def for_sharded_tensor(self, reduce_amax: AmaxReduction) -> "NVFP4Quantizer":
        """Self: sharded tensors are gathered in high precision and cast whole (``gathers_quantized``)."""
        return self


def _random_seed(device: torch.device) -> torch.Tensor:
    """A one-element int64 seed drawn from torch's generator of ``device`` (stochastic rounding)."""
    return torch.randint(-(2**63), 2**63 - 1, (1,), dtype=torch.int64, device=device)


class FixedScaleQuantizer(Quantizer):
    """Per-tensor FP8 casts with a given scale that record no amax: a weight cast again in backward.

    Attributes:
        scale: the 0-d float32 scale.
        amax_scratch: a 0-d float32 slot >= 0 the casts max their amax into (``amax_out``), read by no
            one: it spares each cast a zeroed amax buffer of its own. None: the cast allocates one.
    """

    is_fp8 = True
    casts_from_input_alone = False

    def __init__(self, scale: torch.Tensor, fp8_dtype: torch.dtype, amax_scratch: Optional[torch.Tensor] = None):
        self.scale = scale
        self.fp8_dtype = fp8_dtype
        self.amax_scratch = amax_scratch

    def snapshot(self) -> "FixedScaleQuantizer":
        """A quantizer casting with a copy of the scale taken now (in-place updates of the scale later do
        not reach it). One kernel makes [scale, 0] = scale * [1, 0]: the copy and the amax scratch slot
        (a device-to-device copy of one element costs the host several kernel launches; scale is finite).
        Traced by torch.compile: a clone and a zero slot, which the compiler fuses as it likes."""
        if torch.compiler.is_compiling():
            return FixedScaleQuantizer(self.scale.clone(), self.fp8_dtype, torch.zeros_like(self.scale))
        copy, scratch = torch.mul(self.scale, _one_zero(self.scale.device)).unbind()
        return FixedScaleQuantizer(copy, self.fp8_dtype, scratch)

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> Float8Tensor:
        return _cast(x, self.scale, self.fp8_dtype, columnwise, self.amax_scratch)[0]

    def quantize_transposed(self, x: torch.Tensor) -> Float8Tensor:
        """x^T alone in one pass (``ops.quantize_transposed``): no row-major copy is written."""
        q_t, scale_inv, _ = ops.quantize_transposed(x, self.scale, self.fp8_dtype, amax_out=self.amax_scratch)
        return Float8Tensor(None, scale_inv, q_t)

    def produce(self, run: ProducerFn, columnwise: bool = False):
        """Fused cast with this scale (as :meth:`Float8Quantizer.produce` casts, recording nothing)."""
        return _produced(run, self.scale, self.fp8_dtype, self.amax_scratch)[0]

    def for_recompute(self) -> "FixedScaleQuantizer":
        return self.snapshot()


def _produced(run: ProducerFn, scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: Optional[torch.Tensor]):
    """((the producer's FP8 output as operand, its extras), amax): ``run`` writes FP8 with ``scale``."""
    q, scale_inv, amax, extras = run(scale, fp8_dtype, amax_out)
    return (Float8Tensor(q, scale_inv), extras), amax


@functools.lru_cache(maxsize=None)
def _one_zero(device: torch.device) -> torch.Tensor:
    """The float32 constant [1, 0] on ``device``, made by kernels alone (no host-to-device copy, which a
    CUDA-graph capture would reject if the first use falls inside one)."""
    one_zero = torch.zeros(2, dtype=torch.float32, device=device)  # float32 whatever the default dtype
    one_zero[0] = 1.0
    return one_zero


def _fixed_scale_weight(w, scale, fp8_dtype, amax_out) -> Tuple[Float8Tensor, torch.Tensor]:
    """(w cast with ``scale``, its amax; also into ``amax_out``), W^T deferred to a cast with that same
    scale (copied when forward saves it: ``FixedScaleQuantizer.snapshot``)."""
    operand, amax = _cast(w, scale, fp8_dtype, columnwise=False, amax_out=amax_out)
    operand.deferred_t = DeferredTranspose(w, FixedScaleQuantizer(scale, fp8_dtype))
    return operand, amax


class AmaxObserver(Quantizer):
    """Calibration: record max|x| into a delayed-scaling slot and keep computing in high precision."""

    def __init__(self, target: Float8Quantizer):
        self.target = target

    def quantize(self, x: torch.Tensor, columnwise: bool = False) -> torch.Tensor:
        self.target.record(ops.compute_amax(x))
        return x

    def for_recompute(self) -> Quantizer:
        """High precision without recording: the first run recorded this amax (again would change nothing, at the
        cost of one more pass over the tensor)."""
        return IDENTITY


def _cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, columnwise: bool,
          amax_out: Optional[torch.Tensor] = None) -> Tuple[Float8Tensor, torch.Tensor]:
    """(FP8 operand, amax of x): ``ops.cast_transpose`` (one pass, both layouts) when ``columnwise``, else
    ``ops.quantize``; the amax also max-accumulates into ``amax_out`` when given."""
    if columnwise and x.dim() == 2:
        q, q_t, scale_inv, amax = ops.cast_transpose(x, scale, fp8_dtype, amax_out=amax_out)
        return Float8Tensor(q, scale_inv, q_t), amax
    q, scale_inv, amax = ops.quantize(x, scale, fp8_dtype, amax_out=amax_out)
    return Float8Tensor(q, scale_inv), amax
