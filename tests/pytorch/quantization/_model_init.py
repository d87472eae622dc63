"""What the quantized_model_init tests (``test_model_init*.py``) share: the recipes and modules they run, and the helpers
that build a module under quantized_model_init, run a training step and measure weight memory."""

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling,
)
from transformer_engine.pytorch.tensor import (
    DType, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer, Float8Tensor, MXFP8Tensor, NVFP4Tensor, QuantizedTensor,
)


RECIPES = [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling()]
RECIPE_IDS = ["delayed", "current", "block"]


def _pow2_current() -> CustomRecipe:
    """Current scaling with power-of-two scales (a CustomRecipe: Float8CurrentScaling's weight QParams are fixed)."""
    def qfactory(role):
        fp8_dtype = DType.kFloat8E5M2 if role.startswith("linear_grad") else DType.kFloat8E4M3
        return Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=True)

    return CustomRecipe(qfactory=qfactory)


#: module name -> (constructor, call, names of its GEMM weights)
MODULES = {
    "Linear": (lambda dtype: te.Linear(32, 48, params_dtype=dtype), lambda m, x: m(x), ("weight",)),
    "LayerNormLinear": (lambda dtype: te.LayerNormLinear(32, 48, params_dtype=dtype), lambda m, x: m(x), ("weight",)),
    "LayerNormMLP": (lambda dtype: te.LayerNormMLP(32, 64, params_dtype=dtype), lambda m, x: m(x), ("fc1_weight", "fc2_weight")),
    "GroupedLinear": (lambda dtype: te.GroupedLinear(3, 32, 48, params_dtype=dtype), lambda m, x: m(x, [8, 0, 16]),
                      ("weight0", "weight1", "weight2")),
}


def _build(name, recipe, dtype=torch.bfloat16, preserve=False):
    make = MODULES[name][0]
    with te.quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=preserve):
        return make(dtype)


def _reference(module, name, dtype=torch.bfloat16):
    """The same module with high-precision weights holding the dequantized values (and the same scaling state)."""
    ref = MODULES[name][0](dtype)
    ref.load_state_dict(module.state_dict())
    return ref


def _run(module, name, x, recipe):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = MODULES[name][1](module, x)
    y.float().square().sum().backward()
    return y, x.grad


def _bytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (an FP8 parameter: its data, transpose and scales)."""
    storages = {}
    for t in tensors:
        inner = [t]
        if isinstance(t, Float8Tensor):
            inner = [t._data, t._transpose, t._scale_inv]
        elif isinstance(t, (Float8BlockwiseQTensor, MXFP8Tensor)):
            inner = [t._rowwise_data, t._rowwise_scale_inv, t._columnwise_data, t._columnwise_scale_inv]
        elif isinstance(t, NVFP4Tensor):
            inner = [t._rowwise_data, t._rowwise_scale_inv, t._amax_rowwise, t._columnwise_data, t._columnwise_scale_inv,
                     t._amax_columnwise]
        for s in inner:
            if s is not None:
                storages[s.untyped_storage().data_ptr()] = s.untyped_storage().nbytes()
    return sum(storages.values())


#: MXFP8 blocks need every GEMM dim to be a multiple of 32 (W's rows for W^T's copy, the tokens for x^T's)
MX_MODULES = {
    "Linear": (lambda dtype: te.Linear(64, 96, params_dtype=dtype), ("weight",)),
    "LayerNormLinear": (lambda dtype: te.LayerNormLinear(64, 96, params_dtype=dtype), ("weight",)),
    "LayerNormMLP": (lambda dtype: te.LayerNormMLP(64, 128, params_dtype=dtype), ("fc1_weight", "fc2_weight")),
}


def _mx_build(name, recipe=MXFP8BlockScaling(), preserve=False):
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return MX_MODULES[name][0](torch.bfloat16)


def _mx_run(module, x, recipe=MXFP8BlockScaling()):
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x)
    y.float().square().sum().backward()
    return y, x.grad


def _nv_build(name, recipe=NVFP4BlockScaling(), preserve=False):
    return _mx_build(name, recipe, preserve)


def _nv_run(module, x, recipe=NVFP4BlockScaling(), seed=5):
    """``_mx_run`` with torch's generator seeded first: NVFP4 gradients round stochastically from seeds it draws."""
    torch.manual_seed(seed)
    return _mx_run(module, x, recipe)


def _holding_the_initial_weights(module, ref):
    """``ref`` (a high-precision twin of ``module``) with module's parameters, its FP8 weights as the values they were
    quantized from (``preserve_high_precision_init_val``)."""
    ref.load_state_dict(module.state_dict())
    with torch.no_grad():
        for (name, p), p_ref in zip(module.named_parameters(), ref.parameters()):
            if isinstance(p, QuantizedTensor):
                p_ref.copy_(p.get_high_precision_init_val())
    return ref
