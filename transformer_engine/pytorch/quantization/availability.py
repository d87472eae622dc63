"""What the machine can run: compute capability, FP8 / MXFP8 / block / NVFP4 / BF16 support, the default recipe.

FP8 emulation switch
--------------------
On a CPU, FP8 always runs through the reference backend, which emulates the FP8 math exactly with
torch's float8 dtypes (saturating casts, GEMMs on the dequantized operands in float32): slow, but
numerically the contract. On a CUDA GPU below sm_89 (no FP8 tensor cores) ``autocast(enabled=True)``
raises a ``RuntimeError`` unless emulation is asked for explicitly with the environment variable
``TE_FL_FP8_EMULATION=1`` (read at each ``autocast`` entry; ``0`` or unset = off; any other value
warns and counts as off). With it set, the FP8 ops that the GPU backends decline run on the reference
backend.

Support rules (NVIDIA TE's): FP8 needs sm >= 9.0, or sm 8.9 with CUDA >= 12.1; BF16 needs sm >= 8.0.
Float8BlockScaling needs cuBLASLt's block-scaled FP8 GEMMs: sm 9.x (Hopper) with CUDA >= 12.9 (on a
CPU, or with ``TE_FL_FP8_EMULATION=1``, it runs emulated). MXFP8BlockScaling runs on every device,
emulated exactly (quantize-dequantize with TE's E8M0 rule, then a high-precision GEMM): NVIDIA TE runs
it natively on sm 10.x-11.x only, and TransformerEngine-FL has no native MXFP8 GEMM yet, so the reason
always says "emulated" and why. NVFP4 is not implemented yet by the PyTorch modules, so its check
reports False with that reason.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch

from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe
from transformer_engine.plugin.core.config import read_flag

__all__ = [
    "FP8_EMULATION_ENV",
    "check_fp8_block_scaling_support",
    "check_fp8_support",
    "check_mxfp8_support",
    "check_nvfp4_support",
    "fp8_emulation_requested",
    "get_cudnn_version",
    "get_default_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
]

FP8_EMULATION_ENV = "TE_FL_FP8_EMULATION"


def fp8_emulation_requested() -> bool:
    """True when ``TE_FL_FP8_EMULATION=1``: FP8 may run emulated on a GPU without FP8 hardware (read through
    the plugin config, which warns once about a value other than 0 / 1)."""
    return read_flag(FP8_EMULATION_ENV)


def _cuda_capability() -> Optional[Tuple[int, int]]:
    if not torch.cuda.is_available():
        return None
    if torch.compiler.is_compiling():  # Dynamo folds the properties into a constant (no call in the graph)
        properties = torch.cuda.get_device_properties()
        return properties.major, properties.minor
    return _capability_of(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> Tuple[int, int]:
    """(major, minor) of CUDA device ``index``, asked once: ``te.autocast`` checks it on every entry, and
    ``torch.cuda.get_device_capability`` builds the device's properties object each time (tens of us)."""
    return torch.cuda.get_device_capability(index)


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) compute capability of the current CUDA device; (0, 0) when there is none."""
    return _cuda_capability() or (0, 0)


def get_cudnn_version() -> Tuple[int, int, int]:
    """(major, minor, patch) of the cuDNN that PyTorch loaded; (0, 0, 0) when there is none (a CPU build).

    cuDNN encodes its version as one int: major * 10000 + minor * 100 + patch from 9.0 on (91000 is
    9.10.0), major * 1000 + minor * 100 + patch before (8902 is 8.9.2).

    Example:
        >>> major, minor, patch = get_cudnn_version()
        >>> major >= 0 and 0 <= minor and 0 <= patch
        True
    """
    encoded = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not encoded:
        return (0, 0, 0)
    major, rest = divmod(encoded, 10000 if encoded >= 90000 else 1000)
    minor, patch = divmod(rest, 100)
    return (major, minor, patch)


def _cuda_version() -> Tuple[int, ...]:
    return tuple(int(p) for p in (torch.version.cuda or "0").split(".")[:2])


def check_fp8_support() -> Tuple[bool, str]:
    """(available, reason) for per-tensor FP8 (delayed and current scaling)."""
    capability = _cuda_capability()
    if capability is None:
        return True, "no CUDA device: FP8 runs emulated on the CPU by the reference backend"
    if capability >= (9, 0) or (capability == (8, 9) and _cuda_version() >= (12, 1)):
        return True, ""
    if fp8_emulation_requested():
        return True, f"sm_{capability[0]}{capability[1]} has no FP8 hardware: FP8 is emulated ({FP8_EMULATION_ENV}=1)"
    return False, (
        f"Device compute capability 8.9 or higher required for FP8 execution (this GPU is sm_{capability[0]}{capability[1]}); "
        f"set {FP8_EMULATION_ENV}=1 to emulate FP8 through the reference backend (slow)"
    )


_MXFP8_EMULATED = ("MXFP8 is emulated exactly (E8M0 block scales and FP8 values as NVIDIA TE casts them, then a "
                   "high-precision GEMM on the dequantized operands)")


def check_mxfp8_support() -> Tuple[bool, str]:
    """(available, reason) for MXFP8BlockScaling: available everywhere, the reason says why it is emulated.

    NVIDIA TE needs MXFP8 tensor cores (sm 10.x-11.x); here the reference backend emulates the recipe on
    any device, and no backend offers a native MXFP8 GEMM yet.

    Example:
        >>> available, reason = check_mxfp8_support()
        >>> available, "emulated" in reason
        (True, True)
    """
    capability = _cuda_capability()
    if capability is None:
        return True, f"no CUDA device: {_MXFP8_EMULATED} by the reference backend on the CPU"
    sm = f"sm_{capability[0]}{capability[1]}"
    if (10, 0) <= capability < (12, 0):
        return True, f"{sm} has MXFP8 tensor cores, but TransformerEngine-FL has no native MXFP8 GEMM yet: {_MXFP8_EMULATED}"
    return True, f"{sm} has no MXFP8 tensor cores (NVIDIA TE needs sm 10.x-11.x): {_MXFP8_EMULATED}"


def check_fp8_block_scaling_support() -> Tuple[bool, str]:
    """(available, reason) for Float8BlockScaling: sm 9.x with CUDA >= 12.9, or emulated."""
    capability = _cuda_capability()
    if capability is None:
        return True, "no CUDA device: Float8BlockScaling runs emulated on the CPU by the reference backend"
    if capability[0] == 9 and _cuda_version() >= (12, 9):
        return True, ""
    where = f"this GPU is sm_{capability[0]}{capability[1]} with CUDA {torch.version.cuda}"
    if fp8_emulation_requested():
        return True, f"{where}: Float8BlockScaling is emulated ({FP8_EMULATION_ENV}=1)"
    return False, (
        f"Float8BlockScaling needs cuBLASLt's block-scaled FP8 GEMMs: compute capability 9.x (Hopper) and CUDA >= 12.9 "
        f"({where}); set {FP8_EMULATION_ENV}=1 to emulate it through the reference backend (slow)"
    )


_NVFP4_EMULATED = ("NVFP4 is emulated exactly (E2M1 values, E4M3 block scales and the per-tensor scale as NVIDIA TE "
                   "casts them, then a high-precision GEMM on the dequantized operands)")


def check_nvfp4_support() -> Tuple[bool, str]:
    """(available, reason) for NVFP4BlockScaling: available everywhere, the reason says why it is emulated.

    NVIDIA TE needs FP4 tensor cores (sm 10.0+); here the reference backend emulates the recipe on any
    device, and no backend offers a native NVFP4 GEMM yet. Stochastic rounding draws its own random bits
    (a counter-based hash, the same on every device), not TE's, so runs with it differ from TE's bit for bit.

    Example:
        >>> available, reason = check_nvfp4_support()
        >>> available, "emulated" in reason
        (True, True)
    """
    capability = _cuda_capability()
    if capability is None:
        return True, f"no CUDA device: {_NVFP4_EMULATED} by the reference backend on the CPU"
    sm = f"sm_{capability[0]}{capability[1]}"
    if capability >= (10, 0):
        return True, f"{sm} has FP4 tensor cores, but TransformerEngine-FL has no native NVFP4 GEMM yet: {_NVFP4_EMULATED}"
    return True, f"{sm} has no FP4 tensor cores (NVIDIA TE needs sm 10.0+): {_NVFP4_EMULATED}"


def _answer(result: Tuple[bool, str], return_reason: bool) -> Union[bool, Tuple[bool, str]]:
    return result if return_reason else result[0]


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether per-tensor FP8 can run here; with ``return_reason``, (bool, reason).

    Example:
        >>> import transformer_engine.pytorch as te
        >>> isinstance(te.is_fp8_available(), bool)
        True
    """
    return _answer(check_fp8_support(), return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether MXFP8 can run here; with ``return_reason``, (bool, reason)."""
    return _answer(check_mxfp8_support(), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether Float8BlockScaling can run here; with ``return_reason``, (bool, reason)."""
    return _answer(check_fp8_block_scaling_support(), return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether NVFP4 can run here; with ``return_reason``, (bool, reason)."""
    return _answer(check_nvfp4_support(), return_reason)


def is_bf16_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """BF16: always on a CPU; sm >= 8.0 on a CUDA GPU."""
    capability = _cuda_capability()
    if capability is None or capability >= (8, 0):
        return _answer((True, ""), return_reason)
    return _answer((False, f"BF16 needs compute capability 8.0 or higher (this GPU is sm_{capability[0]}{capability[1]})"), return_reason)


def get_default_recipe() -> Recipe:
    """TE's default: MXFP8BlockScaling on sm 10.x-11.x, Float8CurrentScaling on sm 12.0+, else DelayedScaling."""
    capability = _cuda_capability()
    if capability is not None and (10, 0) <= capability < (12, 0):
        return MXFP8BlockScaling()
    if capability is not None and capability >= (12, 0):
        return Float8CurrentScaling()
    return DelayedScaling()
