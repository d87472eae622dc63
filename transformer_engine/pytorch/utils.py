"""``transformer_engine.pytorch.utils``: the helpers of NVIDIA TE's module of that name that user code imports.

Initializers (Megatron's and TE's tests build modules with them), device queries, small arithmetic, and
``make_weak_ref`` (Megatron-Core's CUDA-graph code: a tensor over the same memory that does not keep it alive).

    init_method_normal(sigma)            w ~ N(0, sigma^2)
    scaled_init_method_normal(sigma, L)  w ~ N(0, sigma^2 / (2 L))
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch

from .quantization.availability import get_cudnn_version, get_device_compute_capability, is_bf16_available

__all__ = [
    "attention_mask_func", "cast_if_needed", "devices_match", "divide", "get_cudnn_version", "get_default_init_method",
    "get_device_compute_capability", "get_sm_count", "gpu_autocast_ctx", "init_method_constant", "init_method_normal",
    "is_bf16_available", "is_bf16_compatible", "is_non_tn_fp8_gemm_supported", "make_weak_ref",
    "round_up_to_nearest_multiple", "scaled_init_method_normal",
]

#: ``torch.autocast`` on CUDA (TE's name for it)
gpu_autocast_ctx = functools.partial(torch.amp.autocast, device_type="cuda")

#: the standard deviation of TE's default weight initialization
DEFAULT_INIT_STD = 0.023


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling a tensor in place with N(0, sigma^2)."""
    return functools.partial(torch.nn.init.normal_, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling with N(0, sigma^2 / (2 num_layers)) (output projections of a num_layers-deep stack)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def init_method_constant(val: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling a tensor in place with ``val``."""
    return functools.partial(torch.nn.init.constant_, val=val)


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """The modules' default weight initializer: N(0, 0.023^2)."""
    return init_method_normal(DEFAULT_INIT_STD)


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores with masked positions (``attention_mask`` True) set to -10000, in place."""
    return attention_scores.masked_fill_(attention_mask, -10000.0)


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator as an int.

    Raises:
        ValueError: the division leaves a remainder.
    """
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def round_up_to_nearest_multiple(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= ``value``.

    Raises:
        ValueError: ``multiple`` is 0.
    """
    if multiple == 0:
        raise ValueError("multiple cannot be zero")
    return -(-value // multiple) * multiple


def cast_if_needed(tensor: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``tensor`` in ``dtype`` (itself when it already is; None stays None), differentiable."""
    if tensor is None or tensor.dtype == dtype:
        return tensor
    with torch.enable_grad():
        return tensor.to(dtype=dtype)


def is_bf16_compatible() -> bool:
    """Whether the current CUDA device computes in bf16 (compute capability 8.0 or higher)."""
    return get_device_compute_capability() >= (8, 0)


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether the current device's FP8 GEMMs take layouts other than TN (compute capability 10.x, 11.x, or 13.0 on)."""
    capability = get_device_compute_capability()
    return (10, 0) <= capability < (12, 0) or capability >= (13, 0)


@functools.lru_cache(maxsize=None)
def get_sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def devices_match(device1, device2) -> bool:
    """Whether two devices are the same one (a CUDA device without an index means the current one)."""
    device1, device2 = torch.device(device1), torch.device(device2)
    if device1.type != device2.type:
        return False
    if device1.type != "cuda":
        return device1 == device2
    current = torch.cuda.current_device() if None in (device1.index, device2.index) else None
    return (current if device1.index is None else device1.index) == (current if device2.index is None else device2.index)


class _Memory:
    """A CUDA buffer described by pointer, dtype and shape (``__cuda_array_interface__``), owning nothing."""

    def __init__(self, tensor: torch.Tensor):
        # bytes as uint8: the interface has no bf16 / fp8 type strings; the caller views them back
        self.__cuda_array_interface__ = {"shape": (tensor.numel() * tensor.element_size(),), "typestr": "|u1",
                                         "data": (tensor.data_ptr(), False), "version": 3}


def make_weak_ref(x: Any) -> Any:
    """A CUDA tensor over the same memory as ``x`` that does not keep that memory alive (tuples, lists and dicts
    element by element; CPU tensors, numbers and None as they are). Reading it after the memory is freed is
    undefined, as with NVIDIA TE's.

    Raises:
        TypeError: any other type. ValueError: a non-contiguous CUDA tensor.
    """
    if isinstance(x, torch.Tensor):
        if not x.is_cuda:
            return x
        if not x.is_contiguous():
            raise ValueError("make_weak_ref needs a contiguous CUDA tensor (its memory is described as one buffer)")
        return torch.as_tensor(_Memory(x), device=x.device).view(x.dtype).view(x.shape)
    if isinstance(x, (tuple, list)):
        return type(x)(make_weak_ref(item) for item in x)
    if isinstance(x, dict):
        return {key: make_weak_ref(value) for key, value in x.items()}
    if x is None or isinstance(x, (int, float, bool)):
        return x
    raise TypeError(f"make_weak_ref takes tensors, tuples, lists, dicts, numbers or None; got {type(x).__name__}")

