"""``NVFP4Tensor`` and ``NVFP4Quantizer``: TE's public NVFP4 tensor (NVFP4BlockScaling), emulated exactly.

    x[i, j] ~= e2m1(rowwise_data)[i, j] * e4m3(rowwise_scale_inv[i, j // 16]) * amax_rowwise / (448 * 6)

for x as the matrix [M, K] = [prod(leading dims), last dim]. Two E2M1 codes share a byte (the first element in
the low nibble); each block of 16 elements along K (or each 16 x 16 tile with ``with_2d_quantization``) has
an E4M3 decode scale, stored as its uint8 bit pattern; each copy has its float32 amax. The exact rule, the
random Hadamard transform (RHT) and the stochastic rounding are those of ``ops.quantize_nvfp4`` (math in
plugin/catalog/nvfp4.py).

Layout, as NVIDIA TE's (all buffers uint8 but the amaxes):

    _rowwise_data         (*lead, K / 2)     blocks of 16 along K
    _rowwise_scale_inv    [M, K / 16]
    _amax_rowwise         float32 [1]
    _columnwise_data      [K, M / 2]         x^T (TE stores it transposed), blocks of 16 along M;
                                             with ``with_rht``: RHT(x^T), rows of 16 transformed
    _columnwise_scale_inv [K, M / 16]
    _amax_columnwise      float32 [1]        amax of what the copy quantizes (of RHT(x^T) with RHT)

The row-wise copy needs K % 16 == 0, the column-wise one M % 16 == 0, 2-D tiles both.

4over6 (``nvfp4_use_4over6``, TE 2.17): each block keeps the better of two candidates, its scale times 1.5
(map-to-4) or not (map-to-6), by ``nvfp4_4over6_err_mode`` ("MAE" or "MSE"); the global scale's E4M3 bound
``nvfp4_e4m3_max`` may then be 256 instead of 448, and the tensor carries it (``_nvfp4_e4m3_max``, as TE's):
x ~= e2m1 * e4m3 * amax / (6 * nvfp4_e4m3_max). The rule is ``ops.quantize_nvfp4``'s (plugin/catalog/nvfp4.py).

What differs from NVIDIA TE, and why:

- scales are compact ([M, K / 16], [K, M / 16]); TE pads them to [roundup(rows, 128), roundup(cols / 16, 4)]
  for cuBLAS (the values are the same; code reading ``_rowwise_scale_inv`` sees ours);
- stochastic rounding draws counter-based random bits from a seed taken from torch's generator of x's
  device (``torch.manual_seed`` repeats a run, on every device); TE draws Philox bits on the GPU;
- the RHT runs on float32 and float16 too (TE: bfloat16 only) and always uses TE's fixed random signs;
- ``with_amax_reduction=True``, ``with_random_sign_mask=False`` with RHT, ``row_scaled_nvfp4=True`` and
  ``with_rht=True`` without ``with_post_rht_amax`` raise (not implemented; TE also refuses the last);
- 4over6 with ``with_rht`` or ``stochastic_rounding`` raises when the quantizer is made (TE: when it casts);
  TE's opt-in float16 4over6 error (``NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH``) is not read;
- the column-wise copy dequantizes when it is x^T (no RHT); TE dequantizes the row-wise copy only. Whether
  it is transformed is what the tensor's quantizer says, so a tensor that holds that copy alone needs one;
- pickles keep the quantizer's settings as plain values (``torch.load(weights_only=True)`` reads them).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from ..quantization.nvfp4_tensor import NVFP4_BLOCK
from ..quantization.nvfp4_tensor import NVFP4Tensor as NVFP4Operand
from ..quantization.quantizer import NVFP4Quantizer as ModuleNVFP4Quantizer
from ._block_scaled import BlockScaledTensor
from .dtype import DType
from .float8_tensor import _as_2d, _matrix_dims, _one_element_f32, _write
from .quantized_tensor import QuantizedTensor, Quantizer, _default_device, check_high_precision

__all__ = ["NVFP4Quantizer", "NVFP4Tensor"]

#: bit i set where sign i of TE's fixed RHT sign vector is -1 (+ + + - + - - - - - - + - + - -)
_RHT_SIGN_MASK = 0xD7E8

#: the constructor keywords of one quantization's buffers, in ``ops.quantize_nvfp4``'s order
_COPY_KEYWORDS = ("rowwise_data", "rowwise_scale_inv", "amax_rowwise", "columnwise_data", "columnwise_scale_inv", "amax_columnwise")


def _rowwise_bytes(shape: Iterable[int]) -> torch.Size:
    """The row-wise data's shape: (*lead, K / 2), two E2M1 codes a byte."""
    shape = torch.Size(shape)
    return torch.Size((*shape[:-1], shape[-1] // 2))


def _columnwise_bytes(shape: Iterable[int]) -> torch.Size:
    """The column-wise data's shape: [K, M / 2] (x^T packed, [M, K] the tensor's matrix)."""
    m, k = _matrix_dims(shape)
    return torch.Size((k, m // 2))


def _scale_grid(shape: Iterable[int], columnwise: bool) -> Tuple[int, int]:
    """The shape of one copy's E4M3 scales: [M, K / 16] row-wise, [K, M / 16] column-wise."""
    m, k = _matrix_dims(shape)
    return (k, m // NVFP4_BLOCK) if columnwise else (m, k // NVFP4_BLOCK)


class NVFP4Quantizer(Quantizer):
    """NVFP4 casts: E2M1 values, an E4M3 scale per 16 elements and a float32 amax per copy (see the module docstring).

    The arguments are NVIDIA TE's, in its order (all may be passed by position).

    Args:
        fp4_dtype: ``DType.kFloat4E2M1``, the only FP4 format.
        rowwise, columnwise: usages (see :class:`Quantizer`): the copies each cast writes.
        with_amax_reduction, amax_reduction_group: TE's all-reduce of the amax over a process group (sharded
            tensors); not implemented (must be False).
        with_rht: quantize the column-wise copy after the random Hadamard transform (TE: inputs, gradients).
        with_post_rht_amax: that copy's amax is the amax of RHT(x^T); required with ``with_rht`` (as in TE),
            no effect without it.
        with_2d_quantization: 16 x 16 tiles (TE: weights).
        stochastic_rounding: round each value to a random neighbour (TE: gradients); see the module docstring.
        row_scaled_nvfp4: one amax per row (TE's ``row_scaled_activation``); not implemented (must be False).
        nvfp4_use_4over6: 4over6, each block's better candidate (see the module docstring); not with ``with_rht``
            or ``stochastic_rounding``.
        nvfp4_e4m3_max: the global scale's E4M3 bound under 4over6, 448 or 256 (448 without 4over6, as TE).
        nvfp4_4over6_err_mode: 4over6's error, "MAE" or "MSE" (any case).
        with_random_sign_mask: TE's fixed random signs in the RHT; False (a plain Hadamard) is not implemented
            with ``with_rht``, no effect without it.

    Attributes: ``dtype`` (the FP4 DType), the flags above, ``rht_matrix_random_sign_mask_t`` (TE's sign mask:
    0xD7E8, or 0 without the random signs).

    Raises:
        ValueError: another fp4_dtype, a bad 4over6 bound or error mode, 4over6 with the RHT or stochastic rounding.
        NotImplementedError: the options not implemented (above).

    Example:
        >>> q = NVFP4Quantizer()
        >>> x = q(torch.full((32, 64), 3.0))
        >>> x._rowwise_data.shape, x._columnwise_data.shape, x._rowwise_scale_inv.shape, x.dequantize().eq(3).all().item()
        (torch.Size([32, 32]), torch.Size([64, 16]), torch.Size([32, 4]), True)
    """

    def __init__(self, fp4_dtype: DType = DType.kFloat4E2M1, rowwise: bool = True, columnwise: bool = True,
                 with_amax_reduction: bool = False, amax_reduction_group=None, with_rht: bool = False,
                 with_post_rht_amax: bool = False, with_2d_quantization: bool = False, stochastic_rounding: bool = False,
                 row_scaled_nvfp4: bool = False, nvfp4_use_4over6: bool = False, nvfp4_e4m3_max: int = 448,
                 nvfp4_4over6_err_mode: str = "MAE", with_random_sign_mask: bool = True) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = _fp4_dtype(fp4_dtype)
        _check_options(with_amax_reduction, with_rht, with_post_rht_amax, with_random_sign_mask)
        _check_row_scaled(row_scaled_nvfp4)
        _check_4over6(nvfp4_use_4over6, nvfp4_e4m3_max if nvfp4_use_4over6 else 448, with_rht=with_rht,
                      stochastic_rounding=stochastic_rounding)
        self.with_amax_reduction, self.amax_reduction_group = False, amax_reduction_group
        self.with_rht, self.with_post_rht_amax = bool(with_rht), bool(with_post_rht_amax)
        self.with_2d_quantization, self.stochastic_rounding = bool(with_2d_quantization), bool(stochastic_rounding)
        self.row_scaled_nvfp4, self.nvfp4_use_4over6 = False, bool(nvfp4_use_4over6)
        self.nvfp4_e4m3_max = nvfp4_e4m3_max if self.nvfp4_use_4over6 else 448  # TE's rule
        self.nvfp4_4over6_err_mode = _err_mode(nvfp4_4over6_err_mode)
        self.rht_matrix_random_sign_mask_t = _RHT_SIGN_MASK if with_random_sign_mask else 0

    def _settings(self) -> Dict[str, Any]:
        """The constructor keywords that make this quantizer again (plain values: pickled with its tensors)."""
        return {"fp4_dtype": self.dtype, "rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage,
                "with_rht": self.with_rht, "with_post_rht_amax": self.with_post_rht_amax,
                "with_2d_quantization": self.with_2d_quantization, "stochastic_rounding": self.stochastic_rounding,
                "nvfp4_use_4over6": self.nvfp4_use_4over6, "nvfp4_e4m3_max": self.nvfp4_e4m3_max,
                "nvfp4_4over6_err_mode": self.nvfp4_4over6_err_mode, "with_random_sign_mask": self.rht_matrix_random_sign_mask_t != 0}

    def copy(self) -> NVFP4Quantizer:
        return NVFP4Quantizer(**self._settings(), amax_reduction_group=self.amax_reduction_group)

    def module_quantizer(self) -> ModuleNVFP4Quantizer:
        """The quantizer the modules cast with under a ``CustomRecipe`` that returns this one (the same rule)."""
        return ModuleNVFP4Quantizer(rht=self.with_rht, block_2d=self.with_2d_quantization, stochastic_rounding=self.stochastic_rounding,
                                    four_over_six=self.nvfp4_4over6_err_mode if self.nvfp4_use_4over6 else None,
                                    e4m3_max=self.nvfp4_e4m3_max)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """Whether ``inp`` has the shape NVFP4 needs: 2 or more dims, the last and the product of the others multiples of 16."""
        m, k = _matrix_dims(inp.shape)
        return inp.dim() >= 2 and k % NVFP4_BLOCK == 0 and m % NVFP4_BLOCK == 0

    def _cast(self, x: torch.Tensor, rowwise: bool, columnwise: bool) -> Tuple[Optional[torch.Tensor], ...]:
        """The six buffers of x (``_COPY_KEYWORDS``), the asked copies only (None for the other): the module quantizer's
        ``ops.quantize_nvfp4`` of the matrix [prod(lead), last], its row-wise data shaped (*lead, K / 2).

        Raises:
            ValueError: neither usage is asked for, or a dim that is not a multiple of 16 (the op names it).
        """
        if not (rowwise or columnwise):
            raise ValueError("NVFP4Quantizer has rowwise=False and columnwise=False; enable at least one usage with set_usage")
        quantizer, x2d = self.module_quantizer(), _as_2d(x)
        q = quantizer.quantize(x2d, columnwise=columnwise) if rowwise else quantizer.quantize_transposed(x2d)
        data = None if q.data is None else q.data.view(_rowwise_bytes(x.shape))
        return data, q.scale_inv, q.amax, q.data_t, q.scale_inv_t, q.amax_t

    def quantize_impl(self, tensor: torch.Tensor) -> NVFP4Tensor:
        check_high_precision(tensor)
        copies = self._cast(tensor.detach(), self.rowwise_usage, self.columnwise_usage)
        return NVFP4Tensor(shape=tensor.shape, dtype=tensor.dtype, **dict(zip(_COPY_KEYWORDS, copies)), fp4_dtype=self.dtype,
                           quantizer=self, device=tensor.device, **self._tensor_flags())

    def _tensor_flags(self) -> Dict[str, Any]:
        """The 4over6 keywords of the tensors this quantizer makes (TE's ``nvfp4_use_4over6``, ``nvfp4_e4m3_max``)."""
        return {"nvfp4_use_4over6": self.nvfp4_use_4over6, "nvfp4_e4m3_max": self.nvfp4_e4m3_max}

    def _tensor_type(self) -> type:
        return NVFP4Tensor

    def _update_quantized(self, src: torch.Tensor, dst: QuantizedTensor) -> NVFP4Tensor:
        """dst = Q(src), written into dst's buffers (the usages dst holds); dst then records this quantizer (its
        settings say what the column-wise copy holds)."""
        usages = dst.get_usages()
        copies = self._cast(src.detach().to(device=dst.device), usages["rowwise"], usages["columnwise"])
        for key, new in zip(dst._rowwise_attrs + dst._columnwise_attrs, copies):
            setattr(dst, key, _write(getattr(dst, key), new))
        dst._quantizer = self.copy()
        dst._nvfp4_use_4over6, dst._nvfp4_e4m3_max = self.nvfp4_use_4over6, self.nvfp4_e4m3_max
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32, device=None,
                   requires_grad: bool = False) -> NVFP4Tensor:
        """An NVFP4Tensor of ``shape`` with uninitialized values, zero scales and zero amaxes (it dequantizes to zeros).

        Raises:
            ValueError: a shape NVFP4 cannot hold (see :meth:`is_quantizable`; the row-wise copy alone needs K % 16 only).
        """
        device, shape = _default_device(device), torch.Size(shape)
        _check_blocks(shape, self.rowwise_usage, self.columnwise_usage)
        copies = [None] * 6
        if self.rowwise_usage:
            copies[:3] = _empty_copy(_rowwise_bytes(shape), _scale_grid(shape, columnwise=False), device)
        if self.columnwise_usage:
            copies[3:] = _empty_copy(_columnwise_bytes(shape), _scale_grid(shape, columnwise=True), device)
        return NVFP4Tensor(shape=shape, dtype=dtype, **dict(zip(_COPY_KEYWORDS, copies)), fp4_dtype=self.dtype, quantizer=self,
                           requires_grad=requires_grad, device=device, **self._tensor_flags())


def _fp4_dtype(fp4_dtype) -> DType:
    """``fp4_dtype`` as ``DType.kFloat4E2M1``, the only FP4 format (ValueError for any other)."""
    te_dtype = DType.cast(fp4_dtype)
    if te_dtype is not DType.kFloat4E2M1:
        raise ValueError(f"fp4_dtype={fp4_dtype!r} is not an FP4 format; NVFP4 uses DType.kFloat4E2M1")
    return te_dtype


def _check_options(with_amax_reduction: bool, with_rht: bool, with_post_rht_amax: bool, with_random_sign_mask: bool) -> None:
    """NotImplementedError for the NVFP4Quantizer options the casts do not implement (never ignored)."""
    if with_amax_reduction:
        raise NotImplementedError(
            "NVFP4Quantizer(with_amax_reduction=True) is not implemented in TransformerEngine-FL: each cast takes the amax of "
            "the tensor it is given; gather the shards and quantize the whole tensor instead"
        )
    if with_rht and not with_post_rht_amax:
        raise NotImplementedError("NVFP4Quantizer(with_rht=True, with_post_rht_amax=False): the column-wise amax of x before "
                                  "the transform is not implemented (nor in NVIDIA TE); pass with_post_rht_amax=True")
    if with_rht and not with_random_sign_mask:
        raise NotImplementedError("NVFP4Quantizer(with_rht=True, with_random_sign_mask=False): the RHT uses TE's fixed "
                                  "random signs only; leave with_random_sign_mask=True")


def _check_row_scaled(row_scaled_nvfp4: bool) -> None:
    """NotImplementedError for row-scaled NVFP4 (one amax per row), which the casts do not implement."""
    if row_scaled_nvfp4:
        raise NotImplementedError("NVFP4Quantizer(row_scaled_nvfp4=True) is not implemented in TransformerEngine-FL: each "
                                  "copy has one amax; leave row_scaled_nvfp4=False")


def _check_4over6(nvfp4_use_4over6: bool, nvfp4_e4m3_max: int, *, with_rht: bool, stochastic_rounding: bool) -> None:
    """ValueError for the 4over6 settings NVIDIA TE refuses: a bound other than 448 or 256, 4over6 with the RHT or
    stochastic rounding (TE refuses those two when it casts; here when the quantizer is made)."""
    if isinstance(nvfp4_e4m3_max, bool) or nvfp4_e4m3_max not in (448, 256):
        raise ValueError(f"nvfp4_e4m3_max={nvfp4_e4m3_max!r}: it must be 448 or 256")
    for on, name in ((with_rht, "with_rht"), (stochastic_rounding, "stochastic_rounding")):
        if nvfp4_use_4over6 and on:
            raise ValueError(f"NVFP4Quantizer(nvfp4_use_4over6=True, {name}=True): NVFP4 4over6 quantization does not support "
                             f"{'RHT' if name == 'with_rht' else 'stochastic rounding'} (as NVIDIA TE); pass {name}=False")


def _err_mode(mode) -> str:
    """4over6's error mode upper-cased, as TE ("MAE" or "MSE"; ValueError otherwise)."""
    if not isinstance(mode, str) or mode.upper() not in ("MAE", "MSE"):
        raise ValueError(f"nvfp4_4over6_err_mode={mode!r}: it must be 'MAE' or 'MSE'")
    return mode.upper()


def _check_blocks(shape: torch.Size, rowwise: bool, columnwise: bool) -> None:
    """ValueError unless the blocks of 16 of each asked copy divide its dim (K row-wise, M column-wise)."""
    m, k = _matrix_dims(shape)
    for name, used, what, n in (("rowwise", rowwise, "last dim", k), ("columnwise", columnwise, "product of the leading dims", m)):
        if used and n % NVFP4_BLOCK:
            raise ValueError(f"an NVFP4Tensor of shape {tuple(shape)} cannot hold {name} data: its {what} ({n}) is not a "
                             f"multiple of {NVFP4_BLOCK}")


def _empty_copy(data_shape: torch.Size, grid: Tuple[int, int], device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uninitialized data, zero E4M3 scales, zero amax) of one copy."""
    return (torch.empty(data_shape, dtype=torch.uint8, device=device), torch.zeros(grid, dtype=torch.uint8, device=device),
            torch.zeros(1, dtype=torch.float32, device=device))


class NVFP4Tensor(BlockScaledTensor):
    """A tensor with NVFP4 data that presents its nominal ``dtype`` (see the module docstring for the layout).

    Args:
        shape: the logical shape. dtype: the nominal (high-precision) dtype.
        rowwise_data: uint8 (*lead, K / 2), or None. rowwise_scale_inv: uint8 [M, K / 16] (E4M3 bits).
        columnwise_data: uint8 [K, M / 2], or None. columnwise_scale_inv: uint8 [K, M / 16].
        amax_rowwise, amax_columnwise: one-element float32 amax of each given copy.
        fp4_dtype: ``DType.kFloat4E2M1``.
        quantizer: the quantizer for in-place updates, whose settings also say what the column-wise copy holds
            (a copy is kept), or None.
        requires_grad, device: as for any tensor (device defaults to the data's).
        nvfp4_use_4over6: the copies were quantized with 4over6 (TE's flag; the decode does not depend on it).
        nvfp4_e4m3_max: the global scale's E4M3 bound of both copies, 448 (or 256 under 4over6): the decode divides
            by 6 * nvfp4_e4m3_max.

    Raises:
        ValueError: no data, a copy without its scales or amax, buffers whose shapes do not fit ``shape``, a dim a
            copy's blocks do not divide, another fp4_dtype, a bound other than 448 or 256. TypeError: data that is
            not uint8.
    """

    _rowwise_attrs = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise")
    _columnwise_attrs = ("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise")
    _format_attr = "_fp4_dtype"
    _layout = ("_nvfp4_e4m3_max",)  # bytes quantized under another bound decode differently

    def __new__(cls, shape: Iterable[int], dtype: torch.dtype, *, rowwise_data: Optional[torch.Tensor],
                rowwise_scale_inv: Optional[torch.Tensor], columnwise_data: Optional[torch.Tensor] = None,
                columnwise_scale_inv: Optional[torch.Tensor] = None, amax_rowwise: Optional[torch.Tensor] = None,
                amax_columnwise: Optional[torch.Tensor] = None, fp4_dtype: DType = DType.kFloat4E2M1,
                quantizer: Optional[Quantizer] = None, requires_grad: bool = False, device=None,
                stride: Optional[Iterable[int]] = None, nvfp4_use_4over6: bool = False, nvfp4_e4m3_max: int = 448):
        shape, fp4_dtype = torch.Size(shape), _fp4_dtype(fp4_dtype)
        copies = (rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data, columnwise_scale_inv, amax_columnwise)
        _check_copies(shape, copies)
        _check_4over6(nvfp4_use_4over6, nvfp4_e4m3_max, with_rht=False, stochastic_rounding=False)
        device = (rowwise_data if rowwise_data is not None else columnwise_data).device if device is None else torch.device(device)
        instance = super().__new__(cls, shape, dtype, requires_grad=requires_grad, device=device, stride=stride)
        for key, value in zip(cls._rowwise_attrs + cls._columnwise_attrs, copies):
            setattr(instance, key, value)
        instance._fp4_dtype = fp4_dtype
        instance._quantizer = None if quantizer is None else quantizer.copy()
        instance._nvfp4_use_4over6, instance._nvfp4_e4m3_max = bool(nvfp4_use_4over6), nvfp4_e4m3_max
        return instance

    def __repr__(self, *, tensor_contents=None) -> str:
        data = self._repr_values() if self._rowwise_data is not None else "<column-wise copy only>"
        return f"NVFP4Tensor(shape={tuple(self.shape)}, usages={self.get_usages()}, data={data})"

    def _buffers(self) -> Tuple[Optional[torch.Tensor], ...]:
        """The six buffers, in ``_COPY_KEYWORDS``' order."""
        return tuple(getattr(self, key) for key in self._rowwise_attrs + self._columnwise_attrs)

    def get_metadata(self) -> Dict[str, Any]:
        return {**dict(zip(_COPY_KEYWORDS, self._buffers())), "fp4_dtype": self._fp4_dtype, "quantizer": self._quantizer,
                "nvfp4_use_4over6": self._nvfp4_use_4over6, "nvfp4_e4m3_max": self._nvfp4_e4m3_max}

    def _get_quantizer(self) -> Quantizer:
        """The tensor's quantizer, or (as NVIDIA TE) a default one for the copies it holds."""
        if self._quantizer is not None:
            return self._quantizer
        return NVFP4Quantizer(rowwise=self._rowwise_data is not None, columnwise=self._columnwise_data is not None)

    def _columnwise_rht(self) -> Optional[bool]:
        """Whether the column-wise copy quantizes RHT(x^T) rather than x^T: the quantizer's ``with_rht``; None when
        there is no quantizer to say."""
        return None if self._quantizer is None else self._quantizer.with_rht

    @classmethod
    def _rowwise_shape(cls, shape: torch.Size) -> torch.Size:
        return _rowwise_bytes(shape)

    @classmethod
    def _columnwise_shape(cls, shape: torch.Size) -> torch.Size:
        return _columnwise_bytes(shape)

    def _with_buffers(self, shape: torch.Size, data: Optional[torch.Tensor], data_t: Optional[torch.Tensor]) -> NVFP4Tensor:
        return NVFP4Tensor(shape=shape, dtype=self.dtype, rowwise_data=data, rowwise_scale_inv=self._rowwise_scale_inv,
                           columnwise_data=data_t, columnwise_scale_inv=self._columnwise_scale_inv, amax_rowwise=self._amax_rowwise,
                           amax_columnwise=self._amax_columnwise, fp4_dtype=self._fp4_dtype, quantizer=self._quantizer,
                           device=self.device, **self._flags())

    def _flags(self) -> Dict[str, Any]:
        """The constructor's 4over6 keywords of this tensor."""
        return {"nvfp4_use_4over6": self._nvfp4_use_4over6, "nvfp4_e4m3_max": self._nvfp4_e4m3_max}

    def _adopt(self, other: NVFP4Tensor) -> None:
        """``t.data = other``: other's buffers, quantizer and 4over6 flags."""
        super()._adopt(other)
        self._nvfp4_use_4over6 = other._nvfp4_use_4over6

    def _copy_bytes(self, src: NVFP4Tensor) -> NVFP4Tensor:
        """The byte copy of the base (the same E4M3 bound: ``_layout``); self then records src's quantizer (what the
        copied column-wise bytes hold) and 4over6 flag."""
        super()._copy_bytes(src)
        self._quantizer = None if src._quantizer is None else src._quantizer.copy()
        self._nvfp4_use_4over6 = src._nvfp4_use_4over6
        return self

    def operand(self) -> NVFP4Operand:
        """The GEMM operand the modules read: the row-wise copy as ``[M, K / 2]``, the column-wise copy as it is
        (``[K, M / 2]``, TE's layout and the op's), flagged as transformed unless the quantizer says it is not."""
        data = None if self._rowwise_data is None else _as_2d(self._rowwise_data)
        two_d = self._quantizer is not None and self._quantizer.with_2d_quantization
        return NVFP4Operand(data, self._rowwise_scale_inv, self._amax_rowwise, self._columnwise_data, self._columnwise_scale_inv,
                            self._amax_columnwise, rht_t=self._columnwise_rht() is not False,
                            block=(NVFP4_BLOCK if two_d else 1, NVFP4_BLOCK), e4m3_max=self._nvfp4_e4m3_max)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """x = e2m1(data) * e4m3(scale_inv) * amax / (6 * e4m3_max) per block (``ops.dequantize_nvfp4``), from the row-wise copy,
        else from the column-wise copy where it is x^T.

        Raises:
            RuntimeError: only the column-wise copy is held and it is RHT(x^T), or no quantizer says it is not.
        """
        rht = self._columnwise_rht()
        if self._rowwise_data is None and rht is not False:
            why = ("it quantizes RHT(x^T) (with_rht=True), not x^T, so x cannot be read back from it" if rht else
                   "no quantizer says whether it quantizes x^T or its Hadamard transform RHT(x^T); pass quantizer= to the constructor")
            raise RuntimeError(f"cannot dequantize an NVFP4Tensor that holds only its column-wise copy: {why}. Keep the "
                               "row-wise copy (rowwise=True) to dequantize")
        return self.operand().dequantize(dtype).reshape(self.shape)

    def _empty_like(self, dtype: Optional[torch.dtype], device) -> NVFP4Tensor:
        """``torch.empty_like``: an NVFP4Tensor of the same shape, copies and quantizer (as NVIDIA TE's)."""
        quantizer = self._get_quantizer().copy()
        quantizer.set_usage(**self.get_usages())
        return quantizer.make_empty(self.shape, dtype=dtype or self.dtype, device=device or self.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.empty_like.default and isinstance(args[0], NVFP4Tensor):
            kwargs = kwargs or {}
            return args[0]._empty_like(kwargs.get("dtype"), kwargs.get("device"))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickle the buffers, amaxes, nominal dtype, shape, the quantizer's settings and the 4over6 flags as plain values."""
        settings = None if self._quantizer is None else self._quantizer._settings()
        return _make_nvfp4_tensor_in_reduce_ex, (self.shape, self.dtype, self._buffers(), self._fp4_dtype, settings,
                                                 self._nvfp4_use_4over6, self._nvfp4_e4m3_max)


def _check_copies(shape: torch.Size, copies: Tuple[Optional[torch.Tensor], ...]) -> None:
    """ValueError (TypeError for non-uint8 data) unless the given copies fit ``shape``: data, scales and amax each."""
    if copies[0] is None and copies[3] is None:
        raise ValueError("an NVFP4Tensor needs rowwise_data, columnwise_data or both; got neither")
    _check_blocks(shape, rowwise=copies[0] is not None, columnwise=copies[3] is not None)
    for name, (data, scales, amax), want, grid in (
        ("rowwise", copies[:3], _rowwise_bytes, _scale_grid(shape, columnwise=False)),
        ("columnwise", copies[3:], _columnwise_bytes, _scale_grid(shape, columnwise=True)),
    ):
        if data is None:
            continue
        if data.dtype != torch.uint8:
            raise TypeError(f"{name}_data has dtype {data.dtype}; NVFP4 data is uint8, two E2M1 codes a byte")
        if data.shape != want(shape):
            raise ValueError(f"{name}_data has shape {tuple(data.shape)}; an NVFP4Tensor of shape {tuple(shape)} needs "
                             f"{tuple(want(shape))}")
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != grid:
            got = f"{scales.dtype} {tuple(scales.shape)}" if isinstance(scales, torch.Tensor) else type(scales).__name__
            raise ValueError(f"{name}_scale_inv must be uint8 E4M3 bits of shape {grid} (one per block of {NVFP4_BLOCK}, "
                             f"unpadded), got {got}")
        _one_element_f32(amax, f"amax_{name}")


def _make_nvfp4_tensor_in_reduce_ex(shape, dtype, buffers, fp4_dtype, settings, nvfp4_use_4over6=False,
                                    nvfp4_e4m3_max=448) -> NVFP4Tensor:
    """Rebuild a pickled NVFP4Tensor (``NVFP4Tensor.__reduce_ex__``): its six buffers, its quantizer from its settings
    (pickles made before 4over6 carry no flags: 448, no 4over6)."""
    quantizer = None if settings is None else NVFP4Quantizer(**settings)
    return NVFP4Tensor(shape=shape, dtype=dtype, **dict(zip(_COPY_KEYWORDS, buffers)), fp4_dtype=fp4_dtype, quantizer=quantizer,
                       nvfp4_use_4over6=nvfp4_use_4over6, nvfp4_e4m3_max=nvfp4_e4m3_max)


torch.serialization.add_safe_globals([NVFP4Tensor, _make_nvfp4_tensor_in_reduce_ex])
