"""``module.quantizers``: each slot's quantizer as NVIDIA TE's public class, casting as the module does.

A module casts with its internal quantizers (``quantization/quantizer.py``: operands for the GEMMs, the
delayed-scaling bookkeeping). TE's API hands users ``module.quantizers["scaling_fwd"]`` /
``["scaling_bwd"]`` as its public quantizers (``isinstance(q, Float8Quantizer)``, ``q.scale``, ``q(x)`` giving
a quantized tensor); here each is made from the internal one, on the first access after the states change:

| recipe | public quantizer of slot i |
|---|---|
| DelayedScaling | :class:`SlotQuantizer`: a ``Float8Quantizer`` whose scale and amax are views of the state's ``scale[i]`` and ``amax_history[0, i]`` |
| Float8CurrentScaling | ``Float8CurrentScalingQuantizer`` of the slot's QParams |
| Float8BlockScaling | ``Float8BlockQuantizer`` of the slot's tiles and QParams |
| MXFP8BlockScaling | ``MXFP8Quantizer`` |
| NVFP4BlockScaling | ``NVFP4Quantizer`` of the slot's RHT, tiles, stochastic rounding and 4over6 |
| CustomRecipe | the quantizer ``qfactory`` returned for the slot's role |
"""  # noqa: E501

from __future__ import annotations

from typing import List, Optional

import torch

from ..quantization.quantizer import Float8BlockQuantizer as ModuleBlockQuantizer
from ..quantization.quantizer import Float8CurrentScalingQuantizer as ModuleCurrentScalingQuantizer
from ..quantization.quantizer import Float8Quantizer as ModuleDelayedQuantizer
from ..quantization.quantizer import MXFP8Quantizer as ModuleMXFP8Quantizer
from ..quantization.quantizer import NVFP4Quantizer as ModuleNVFP4Quantizer
from ..quantization.quantizer import Quantizer as ModuleQuantizer
from ..quantization.recipe_state import CustomRecipeState, RecipeState
from ..tensor.float8_blockwise_tensor import Float8BlockQuantizer
from ..tensor.dtype import DType
from ..tensor.float8_tensor import Float8CurrentScalingQuantizer, Float8Quantizer
from ..tensor.mxfp8_tensor import MXFP8Quantizer
from ..tensor.nvfp4_tensor import NVFP4Quantizer
from ..tensor.quantized_tensor import Quantizer

__all__ = ["SlotQuantizer", "public_quantizer", "public_quantizers"]


class SlotQuantizer(Float8Quantizer):
    """A public ``Float8Quantizer`` whose scale, amax and FP8 format are slot ``index`` of a module's delayed-scaling
    state ``fp8_meta[key]``, looked up at each cast: the state replaces its tensors when the history length changes,
    the module moves, or a checkpoint is loaded, takes the format of a new recipe, and the quantizer must follow.

    scale = fp8_meta[key].scale[index], amax = fp8_meta[key].amax_history[0, index] (one-element views)
    """

    def __init__(self, fp8_meta: dict, index: int, *, key: str = "scaling_fwd", rowwise: bool = True, columnwise: bool = True) -> None:
        Quantizer.__init__(self, rowwise=rowwise, columnwise=columnwise)  # pylint: disable=non-parent-init-called
        self._fp8_meta, self._key, self._index = fp8_meta, key, index

    @property
    def dtype(self) -> DType:
        return DType.cast(self._fp8_meta[self._key].fp8_dtype)

    @property
    def scale(self) -> torch.Tensor:
        return self._fp8_meta[self._key].scale[self._index:self._index + 1]

    @property
    def amax(self) -> torch.Tensor:
        return self._fp8_meta[self._key].amax_history[0, self._index:self._index + 1]

    def copy(self) -> "SlotQuantizer":
        return SlotQuantizer(self._fp8_meta, self._index, key=self._key, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)


def public_quantizer(module_quantizer: ModuleQuantizer, fp8_meta: dict, key: str, index: int) -> Quantizer:
    """The public quantizer of slot ``index`` of ``fp8_meta[key]`` that casts as ``module_quantizer`` (both usages).

    Raises:
        TypeError: a module quantizer with no public counterpart (the calibration and identity ones).
    """
    if isinstance(module_quantizer, ModuleDelayedQuantizer):
        return SlotQuantizer(fp8_meta, index, key=key)
    if isinstance(module_quantizer, ModuleCurrentScalingQuantizer):
        qparams = module_quantizer.qparams
        return Float8CurrentScalingQuantizer(module_quantizer.fp8_dtype, force_pow_2_scales=qparams.power_2_scale,
                                             amax_epsilon=qparams.amax_epsilon)
    if isinstance(module_quantizer, ModuleBlockQuantizer):
        qparams = module_quantizer.qparams
        return Float8BlockQuantizer(module_quantizer.fp8_dtype, rowwise=True, columnwise=True, amax_epsilon=qparams.amax_epsilon,
                                    force_pow_2_scales=qparams.power_2_scale, block_scaling_dim=2 if module_quantizer.block[0] > 1 else 1)
    if isinstance(module_quantizer, ModuleMXFP8Quantizer):
        return MXFP8Quantizer(module_quantizer.fp8_dtype)
    if isinstance(module_quantizer, ModuleNVFP4Quantizer):
        rht = module_quantizer.rht
        four_over_six = module_quantizer.four_over_six
        return NVFP4Quantizer(with_rht=rht, with_post_rht_amax=rht, with_2d_quantization=module_quantizer.block_2d,
                              stochastic_rounding=module_quantizer.stochastic_rounding, nvfp4_use_4over6=four_over_six is not None,
                              nvfp4_e4m3_max=module_quantizer.e4m3_max, nvfp4_4over6_err_mode=four_over_six or "MAE")
    raise TypeError(f"{type(module_quantizer).__name__} has no public quantizer class")


def public_quantizers(fp8_meta: dict, key: str, module_quantizers: List[ModuleQuantizer]) -> List[Quantizer]:
    """``module.quantizers[key]``: the public quantizer of each slot of ``fp8_meta[key]`` (a CustomRecipe's: those its
    factory returned, which its module quantizers cast as; none before the module has states)."""
    state: Optional[RecipeState] = fp8_meta[key]
    if isinstance(state, CustomRecipeState):
        return list(state.factory_quantizers)
    return [public_quantizer(q, fp8_meta, key, i) for i, q in enumerate(module_quantizers)]
