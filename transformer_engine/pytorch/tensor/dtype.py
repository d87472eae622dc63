"""``DType``: TE's data-type tags, and their mapping to torch dtypes.

NVIDIA TE defines this enum in its C++ extension (``transformer_engine_torch.DType``) and re-exports it
as ``transformer_engine.pytorch.DType``; here it is a plain ``IntEnum`` with the same member names and
integer values (those of ``NVTEDType``), so pickles and ``int(dtype)`` agree with TE.

    DType.kFloat8E4M3 <-> torch.float8_e4m3fn   (fp8_max = 448)
    DType.kFloat8E5M2 <-> torch.float8_e5m2     (fp8_max = 57344)
"""

from __future__ import annotations

import enum
from typing import Union

import torch

__all__ = ["DType", "TE_DType", "TE_DType_To_Torch", "fp8_torch_dtype"]


class DType(enum.IntEnum):
    """TE data types (values as in TE's ``NVTEDType``).

    Example:
        >>> DType.cast(torch.float8_e5m2)
        <DType.kFloat8E5M2: 8>
        >>> TE_DType_To_Torch[DType.kBFloat16]
        torch.bfloat16
    """

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10

    @classmethod
    def cast(cls, dtype: Union["DType", int, torch.dtype]) -> "DType":
        """``dtype`` as a ``DType`` member: a member, its integer value, or a torch dtype of the table.

        Raises:
            ValueError: ``dtype`` names no member.
        """
        if isinstance(dtype, torch.dtype):
            if dtype not in TE_DType:
                raise ValueError(f"torch dtype {dtype} has no TE DType; use one of {sorted(map(str, TE_DType))}")
            return TE_DType[dtype]
        if isinstance(dtype, bool) or not isinstance(dtype, int):
            raise ValueError(f"{dtype!r} is not a TE DType; pass e.g. DType.kFloat8E4M3 or torch.float8_e4m3fn")
        return cls(dtype)


#: torch dtype -> DType (TE's ``constants.TE_DType``).
TE_DType = {
    torch.uint8: DType.kByte,
    torch.int32: DType.kInt32,
    torch.float32: DType.kFloat32,
    torch.float16: DType.kFloat16,
    torch.bfloat16: DType.kBFloat16,
    torch.float8_e4m3fn: DType.kFloat8E4M3,
    torch.float8_e5m2: DType.kFloat8E5M2,
}

#: DType -> torch dtype (kFloat4E2M1 has no unpacked torch dtype).
TE_DType_To_Torch = {te_dtype: torch_dtype for torch_dtype, te_dtype in TE_DType.items()}

_FP8 = (DType.kFloat8E4M3, DType.kFloat8E5M2)


def fp8_torch_dtype(fp8_dtype: Union[DType, int, torch.dtype]) -> torch.dtype:
    """The torch float8 dtype of an FP8 ``DType`` (or of that torch dtype itself).

    Raises:
        ValueError: ``fp8_dtype`` is not E4M3 or E5M2.
    """
    te_dtype = DType.cast(fp8_dtype)
    if te_dtype not in _FP8:
        raise ValueError(f"fp8_dtype={fp8_dtype!r} is not a per-tensor FP8 format; use DType.kFloat8E4M3 or DType.kFloat8E5M2")
    return TE_DType_To_Torch[te_dtype]
