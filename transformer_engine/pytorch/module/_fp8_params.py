"""FP8 weight parameters: what ``quantized_model_init`` makes of a module's GEMM weights.

Under ``quantized_model_init(enabled=True, recipe=DelayedScaling() | Float8CurrentScaling())`` each GEMM
weight W [N, K] is a :class:`~transformer_engine.pytorch.tensor.Float8Tensor` parameter (TE's public class);
under ``Float8BlockScaling`` a :class:`~transformer_engine.pytorch.tensor.Float8BlockwiseQTensor` in the recipe's
weight tiles (128 x 128 by default: row-wise data and one scale per tile, 0.5x of bf16; dgrad's W^T is the
exact transpose of the tiles; 1 x 128 weight tiles keep their column-wise copy too, 1.0x of bf16, since it
is a quantization of W^T); under ``MXFP8BlockScaling`` an
:class:`~transformer_engine.pytorch.tensor.MXFP8Tensor` holding both of W's copies (blocks of 32 along K for
fprop, along N for dgrad's W^T: two quantizations, neither made from the other; 1.0x of bf16 plus the
E8M0 scales, as NVIDIA TE's MXFP8 weights); under ``NVFP4BlockScaling`` an
:class:`~transformer_engine.pytorch.tensor.NVFP4Tensor` holding both of the module's quantizations of W (16 x 16
tiles by default, the recipe's weight settings: half a byte per element and copy, 0.5x of bf16 plus the E4M3
tile scales):

- storage: W's row-wise FP8 data (1 byte per element) and its float32 ``scale_inv``, nothing else:
  0.5x the bytes of a bf16 weight plus 4. No transposed copy is kept (TE on Hopper keeps one, 1.0x of
  bf16): dgrad's W^T is the stored bytes transposed in backward (:class:`StoredTranspose`, exact, freed
  after the dgrad GEMM), which is a byte copy, not a cast;
- quantization, the recipe's weight semantics: delayed scaling casts with the module's weight slot
  (``scale[3g + 1]``, its amax max-accumulated into ``amax_history[0, 3g + 1]`` for the next update),
  current scaling with W's own scale fp8_max / amax(W) (the recipe's ``fp8_quant_fwd_weight``),
  ``CustomRecipe`` with ``qfactory("linear_weight")``;
- forward: the parameter's FP8 data and scale_inv are the fprop operand as they are (no cast per step);
  outside FP8 autocast (or calibrating) the module runs on the dequantized weight;
- gradients: dW in the parameter's nominal (high-precision) dtype, as TE;
- updates: ``param.copy_(w_hp)`` (an optimizer's fp32 master) re-quantizes in place with the same
  quantizer; with ``preserve_high_precision_init_val`` the initial values stay on the CPU
  (``param.get_high_precision_init_val()``, ``param.clear_high_precision_init_val()``).
"""

from __future__ import annotations

import types
from typing import Optional, Union

import torch

from transformer_engine.common.recipe import CustomRecipe, Recipe

from ..quantization.float8_tensor import Float8Tensor as Float8Operand
from ..quantization.quantizer import Float8BlockQuantizer as ModuleBlockQuantizer
from ..quantization.quantizer import MXFP8Quantizer as ModuleMXFP8Quantizer
from ..quantization.quantizer import NVFP4Quantizer as ModuleNVFP4Quantizer
from ..quantization.quantizer import Quantizer as ModuleQuantizer
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer, Float8BlockwiseQTensor
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from ..tensor.mxfp8_tensor import MXFP8Quantizer, MXFP8Tensor
from ..tensor.nvfp4_tensor import NVFP4Quantizer, NVFP4Tensor
from ..tensor.quantized_tensor import QuantizedTensor, Quantizer
from ._public_quantizers import public_quantizer

__all__ = ["attach_high_precision_init_val", "fp8_param_operand", "quantize_param", "weight_param_quantizer"]

#: the block-scaled public tensors: a weight stored as one is read through its row-wise and column-wise copies
_BLOCK_SCALED = (Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor)


def weight_param_quantizer(recipe: Recipe, module_quantizer: ModuleQuantizer, fp8_meta: dict, index: int) -> Quantizer:
    """The public quantizer that stores (and re-quantizes) a weight as the recipe casts weights (the slot's public
    quantizer, see ``_public_quantizers``): row-wise only, but for 1 x 128 block tiles (their column-wise copy is
    W^T's own quantization, which the row-wise FP8 values cannot give), MXFP8 and NVFP4 (both copies, unless
    built with gradients off: NVIDIA TE's heuristic for inference, whose GEMMs read the row-wise copy only).

    Args:
        recipe: the ``quantized_model_init`` recipe.
        module_quantizer: the module's quantizer of the weight's forward slot ``index``.
        fp8_meta: the module's ``fp8_meta`` (delayed scaling reads its state at each cast).

    Raises:
        NotImplementedError: a recipe whose weights cannot be stored quantized yet (a CustomRecipe returning
            another quantizer).
    """
    if isinstance(recipe, CustomRecipe):
        made = recipe.qfactory("linear_weight")
        if not isinstance(made, (Float8Quantizer, Float8CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer)):
            raise NotImplementedError(
                f"quantized_model_init with a CustomRecipe whose qfactory('linear_weight') returns {type(made).__name__}: "
                "quantized parameters need a Float8Quantizer, Float8CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer "
                "or NVFP4Quantizer"
            )
        made = made.copy()
    else:
        try:
            made = public_quantizer(module_quantizer, fp8_meta, "scaling_fwd", index)
        except TypeError:
            raise NotImplementedError(
                f"quantized_model_init with {type(recipe).__name__}: storing the weights in this recipe's format is not "
                "implemented yet; use DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling or NVFP4BlockScaling, "
                "or build the model outside quantized_model_init"
            ) from None
    if isinstance(made, Float8BlockQuantizer):  # 1 x 128 tiles keep W^T's own quantization
        made.set_usage(rowwise=True, columnwise=made.block_scaling_dim == 1)
    elif isinstance(made, (MXFP8Quantizer, NVFP4Quantizer)):  # built under no_grad (inference): the row-wise copy only, as TE
        made.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())
    else:
        made.set_usage(rowwise=True, columnwise=False)  # one FP8 copy: W^T is transposed from it in backward
    return made


def quantize_param(param: torch.Tensor, quantizer: Quantizer, preserve_init_val: bool) -> torch.nn.Parameter:
    """A new FP8 parameter holding Q(param), with ``param``'s attributes (tensor-parallel layout, ...) and,
    with ``preserve_init_val``, a CPU copy of its values (:func:`attach_high_precision_init_val`)."""
    init_val = param.detach().to("cpu", copy=True) if preserve_init_val else None
    with torch.no_grad():
        fp8 = quantizer.quantize_impl(param.detach())
    new = torch.nn.Parameter(fp8, requires_grad=param.requires_grad)
    for key, value in param.__dict__.items():
        setattr(new, key, value)
    if init_val is not None:
        attach_high_precision_init_val(new, init_val)
    return new


def _get_high_precision_init_val(self) -> Optional[torch.Tensor]:
    """The CPU copy of the values this parameter was initialized with, or None once cleared."""
    return getattr(self, "_high_precision_init_val", None)


def _clear_high_precision_init_val(self) -> None:
    """Free the CPU copy of the initial values (e.g. once optimizer master weights are made from it)."""
    if hasattr(self, "_high_precision_init_val"):
        del self._high_precision_init_val


def attach_high_precision_init_val(param: torch.Tensor, init_val: torch.Tensor) -> None:
    """Give ``param`` TE's ``_high_precision_init_val`` and its two accessor methods (bound, so copies of
    the parameter get their own)."""
    param._high_precision_init_val = init_val
    param.get_high_precision_init_val = types.MethodType(_get_high_precision_init_val, param)
    param.clear_high_precision_init_val = types.MethodType(_clear_high_precision_init_val, param)


def fp8_param_operand(weight: torch.Tensor, quantizer: ModuleQuantizer) -> Optional[Float8Operand]:
    """The fprop operand of an FP8 weight parameter as stored (its data and scale_inv, no cast), with W^T
    for dgrad from its stored transpose or its bytes transposed in backward (block-scaled: its column-wise
    copy, or the transpose of its 128 x 128 tiles; MXFP8: its column-wise copy); None when the call does not run in FP8 (high precision,
    calibration) or the weight is not stored as this call's quantizer reads it: the caller then casts the
    dequantized weight."""
    if isinstance(weight, _BLOCK_SCALED):
        return _operand(weight) if weight.dim() == 2 and weight._rowwise_data is not None and _reads(quantizer, weight) else None
    if not quantizer.is_fp8 or not isinstance(weight, Float8Tensor) or weight._data is None or weight.dim() != 2:
        return None
    return _operand(weight)


def _operand(weight: QuantizedTensor):
    """``weight.operand()`` called through its class: torch.compile traces that function of the tensor's buffers,
    where it would record a method call on a tensor subclass as one opaque graph op and fail."""
    return type(weight).operand(weight)


def _reads(quantizer: ModuleQuantizer, weight: Union[Float8BlockwiseQTensor, MXFP8Tensor, NVFP4Tensor]) -> bool:
    """Whether ``quantizer``'s GEMMs read ``weight`` as stored: block tiles of the same shape, or MXFP8 / NVFP4 (of the
    same settings) with both copies (the row-wise one alone where gradients are off)."""
    if isinstance(weight, Float8BlockwiseQTensor):
        return isinstance(quantizer, ModuleBlockQuantizer) and quantizer.block == weight._block
    has_copies = weight._columnwise_data is not None or not torch.is_grad_enabled()  # a dgrad may follow: it reads the column-wise copy
    if isinstance(weight, NVFP4Tensor):
        return isinstance(quantizer, ModuleNVFP4Quantizer) and has_copies and _casts_alike(quantizer, type(weight)._get_quantizer(weight))
    return isinstance(weight, MXFP8Tensor) and isinstance(quantizer, ModuleMXFP8Quantizer) and has_copies


def _casts_alike(quantizer: ModuleNVFP4Quantizer, stored: NVFP4Quantizer) -> bool:
    """Whether an NVFP4 weight stored by ``stored`` holds what ``quantizer`` casts (the same tiles, transform and 4over6 rule;
    stochastic rounding draws new bits per cast, so a stored stochastic quantization is one of its casts). The caller reads
    ``stored`` through the tensor's class, as :func:`_operand` does."""
    four_over_six = stored.nvfp4_4over6_err_mode if stored.nvfp4_use_4over6 else None
    return (quantizer.block_2d == stored.with_2d_quantization and quantizer.rht == stored.with_rht
            and (quantizer.four_over_six, quantizer.e4m3_max) == (four_over_six, stored.nvfp4_e4m3_max))
