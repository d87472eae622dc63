"""``Fp8Padding`` / ``Fp8Unpadding``: pad each row split of a grouped-GEMM input to the quantization alignment.

A grouped GEMM (``GroupedLinear``) runs one GEMM per split x = [x_0; ...; x_{n-1}], x_i of m_i rows. FP8
kernels want every split's row count to be a multiple of an alignment a (16 for per-tensor and 1x128
block FP8, 32 for MXFP8's 32-row blocks, 128 for NVFP4), so the splits are padded with zero rows:

    p_i = ceil(m_i / a) a,    pad(x)  = [x_0; 0_{p_0 - m_0}; x_1; 0_{p_1 - m_1}; ...]   ([sum p_i, K])
    unpad(y) = [y_0[:m_0]; y_1[:m_1]; ...]                                                ([sum m_i, K])

Both are a row gather / scatter with one index, d[r] = r + (P_i - M_i) for row r of split i (P_i, M_i the
padded and unpadded row offsets of split i), so each is one differentiable torch op and its VJP is the
other: d pad / dx = unpad(dy), d unpad / dy = pad(dx) (the padding rows get no gradient).
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import torch

from transformer_engine.common.recipe import Recipe

from ..quantization.global_state import FP8GlobalStateManager

__all__ = ["Fp8Padding", "Fp8Unpadding", "get_align_size_for_quantization"]

_PER_TENSOR_ALIGN = 16  # per-tensor (delayed / current) and 1x128 block FP8: 16-row GEMM operands
_MXFP8_ALIGN = 32  # MXFP8: one E8M0 scale per 32 rows of the transposed (wgrad) operand
_NVFP4_ALIGN = 128  # NVFP4: 128-row tiles of the swizzled block scales


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """Row alignment of grouped quantized GEMMs under ``recipe``.

    ``CustomRecipe``: its ``quantization_alignment``; MXFP8: 32; NVFP4: 128; every other recipe: 16.

    Example:
        >>> from transformer_engine.common.recipe import DelayedScaling, MXFP8BlockScaling
        >>> get_align_size_for_quantization(DelayedScaling()), get_align_size_for_quantization(MXFP8BlockScaling())
        (16, 32)
    """
    if recipe.custom():
        return recipe.quantization_alignment
    if recipe.mxfp8():
        return _MXFP8_ALIGN
    if recipe.nvfp4():
        return _NVFP4_ALIGN
    return _PER_TENSOR_ALIGN


def _check_config(num_gemms: int, align_size: Optional[int]) -> None:
    for name, value, allow_none in (("num_gemms", num_gemms, False), ("align_size", align_size, True)):
        if value is None and allow_none:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


def _check_splits(m_splits: Sequence[int], num_gemms: int) -> None:
    if len(m_splits) != num_gemms:
        raise ValueError(f"m_splits has {len(m_splits)} entries but num_gemms={num_gemms}: give one row count per GEMM")
    for m in m_splits:
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"m_splits={list(m_splits)} must hold non-negative Python ints (got {m!r})")


def _check_rows(inp: torch.Tensor, splits: Sequence[int], what: str) -> None:
    """Raise unless ``inp`` is [..., K] with sum(splits) rows (its leading dims flattened)."""
    if not isinstance(inp, torch.Tensor) or inp.dim() < 2:
        raise ValueError(f"inp must be a tensor [rows, K] (leading dims are flattened), got {type(inp).__name__} "
                         f"of shape {tuple(getattr(inp, 'shape', ()))}")
    if inp.shape[:-1].numel() != sum(splits):
        raise ValueError(f"inp has {inp.shape[:-1].numel()} rows but the {what} splits {list(splits)} sum to {sum(splits)}")


def _padded_splits(m_splits: Sequence[int], align: int) -> List[int]:
    """p_i = ceil(m_i / a) a."""
    return [(m + align - 1) // align * align for m in m_splits]


def _unpadded_rows_in_padded(m_splits: Sequence[int], padded: Sequence[int], device: torch.device) -> torch.Tensor:
    """d [sum m_i] int64: d[r] = r + (P_i - M_i), the padded row of unpadded row r of split i."""
    offsets = zip(itertools.accumulate(padded, initial=0), itertools.accumulate(m_splits, initial=0))
    shift = [p_off - m_off for p_off, m_off in offsets]
    total = sum(m_splits)
    host = torch.tensor(shift[:-1] + list(m_splits), dtype=torch.int64)  # one host-to-device copy for both
    shift_and_rows = host.to(device, non_blocking=True)
    n = len(m_splits)
    shift_per_row = torch.repeat_interleave(shift_and_rows[:n], shift_and_rows[n:], output_size=total)
    return torch.arange(total, dtype=torch.int64, device=device) + shift_per_row


class _AlignedSplits(torch.nn.Module):
    """Shared state of the two modules: ``num_gemms`` and the alignment, fixed on the first forward."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        _check_config(num_gemms, align_size)
        self.num_gemms = num_gemms
        self.align_size = align_size

    def _align(self) -> int:
        """The alignment: as given, else the active recipe's (read once, on the first forward, as TE does)."""
        if self.align_size is None:
            self.align_size = get_align_size_for_quantization(FP8GlobalStateManager.get_fp8_recipe())
        return self.align_size

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"


class Fp8Padding(_AlignedSplits):
    """Pads every row split of a grouped-GEMM input with zero rows up to a multiple of the alignment.

    Args:
        num_gemms: number of splits (GEMMs of the group).
        align_size: row alignment a; None = from the active recipe on the first forward
            (:func:`get_align_size_for_quantization`: 32 MXFP8, 128 NVFP4, 16 otherwise).

    Example:
        >>> pad = Fp8Padding(2, align_size=4)
        >>> y, splits = pad(torch.ones(5, 2), [3, 2])
        >>> splits, y[:, 0].tolist()
        ([4, 4], [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    """

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> Tuple[torch.Tensor, List[int]]:
        """pad(x) [sum p_i, K] and p = [p_0, ...]; ``inp`` itself and ``m_splits`` when every m_i is aligned.

        Raises:
            ValueError: ``m_splits`` not ``num_gemms`` non-negative ints summing to inp's row count.
        """
        _check_splits(m_splits, self.num_gemms)
        _check_rows(inp, m_splits, "unpadded")
        padded = _padded_splits(m_splits, self._align())
        if padded == list(m_splits):
            return inp, m_splits
        x = inp.reshape(-1, inp.shape[-1])
        rows = _unpadded_rows_in_padded(m_splits, padded, x.device)
        out = x.new_zeros((sum(padded), x.shape[1])).index_copy(0, rows, x)
        return out, padded


class Fp8Unpadding(_AlignedSplits):
    """Drops the zero rows :class:`Fp8Padding` added: the inverse, given the same unpadded ``m_splits``.

    Args:
        num_gemms: number of splits (GEMMs of the group).
        align_size: row alignment a the input was padded to; None = from the active recipe on the first
            forward (as :class:`Fp8Padding`).

    Example:
        >>> unpad = Fp8Unpadding(2, align_size=4)
        >>> unpad(torch.arange(8.0)[:, None], [3, 2])[:, 0].tolist()
        [0.0, 1.0, 2.0, 4.0, 5.0]
    """

    def forward(self, inp: torch.Tensor, m_splits: List[int]) -> torch.Tensor:
        """unpad(y) [sum m_i, K] from y [sum p_i, K]; ``inp`` itself when every m_i is aligned.

        Raises:
            ValueError: ``m_splits`` not ``num_gemms`` non-negative ints, or their padded sizes do not sum to
                inp's row count.
        """
        _check_splits(m_splits, self.num_gemms)
        padded = _padded_splits(m_splits, self._align())
        _check_rows(inp, padded, "padded")
        if padded == list(m_splits):
            return inp
        y = inp.reshape(-1, inp.shape[-1])
        return y.index_select(0, _unpadded_rows_in_padded(m_splits, padded, y.device))
