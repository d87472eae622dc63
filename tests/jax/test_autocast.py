"""autocast / fp8_autocast: recipe state, nesting, refusal of recipes the JAX path cannot run."""

import pytest

from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from transformer_engine.jax import MeshResource, autocast, fp8_autocast, update_collections
from transformer_engine.jax import quantize as q
from transformer_engine.jax import sharding


def test_nesting_restores_and_disables():
    assert q.get_global_quantize_recipe() is None
    with autocast(enabled=True):
        assert isinstance(q.get_global_quantize_recipe(), DelayedScaling)  # recipe=None -> DelayedScaling()
        with autocast(enabled=True, recipe=Float8CurrentScaling()):
            assert q.get_global_quantize_config().scaling_mode == q.ScalingMode.CURRENT_TENSOR_SCALING
            with autocast(enabled=False):
                assert q.get_global_quantize_recipe() is None
            assert isinstance(q.get_global_quantize_recipe(), Float8CurrentScaling)
        assert q.get_global_quantize_config().amax_history_len == 1024
    assert q.get_global_quantize_recipe() is None


def test_mesh_resource_is_set_and_restored():
    resource = MeshResource(dp_resource="data")
    with autocast(mesh_resource=resource):
        assert sharding._GLOBAL_MESH_RESOURCE is resource
    assert sharding._GLOBAL_MESH_RESOURCE is None
    with pytest.raises(TypeError, match="MeshResource"):
        with autocast(mesh_resource={"dp_resource": "data"}):
            pass


def test_fp8_autocast_is_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="autocast"):
        with fp8_autocast(enabled=True, fp8_recipe=MXFP8BlockScaling()):
            assert q.get_global_quantize_config().scaling_mode == q.ScalingMode.MXFP8_1D_SCALING


@pytest.mark.parametrize(
    "recipe,message",
    [
        (Float8BlockScaling(), "Float8BlockScaling is not implemented"),
        (NVFP4BlockScaling(), "NVFP4BlockScaling is not implemented"),
        (DelayedScaling(amax_compute_algo=lambda h: h[0]), "amax_compute_algo"),
        (DelayedScaling(reduce_amax=False), "reduce_amax=False"),
        (DelayedScaling(fp8_dpa=True), "fp8_dpa=True"),
    ],
)
def test_unsupported_recipes_are_refused_by_name(recipe, message):
    with pytest.raises(NotImplementedError, match=message):
        with autocast(enabled=True, recipe=recipe):
            pass
    with autocast(enabled=False, recipe=recipe):  # a disabled autocast never looks at the recipe
        assert q.get_global_quantize_recipe() is None


def test_recipe_type_error_and_support_queries():
    with pytest.raises(TypeError, match="Recipe"):
        with autocast(enabled=True, recipe="delayed"):
            pass
    assert q.is_scaling_mode_supported(q.ScalingMode.DELAYED_TENSOR_SCALING) == (True, "")
    assert q.is_scaling_mode_supported(q.ScalingMode.NVFP4_1D_SCALING)[0] is False
    assert [type(r).__name__ for r in q.get_supported_quantization_recipes()] == [
        "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"]
    assert isinstance(q.get_quantization_recipe("delayedscaling"), DelayedScaling)
    with pytest.raises(ValueError, match="unknown quantization recipe"):
        q.get_quantization_recipe("bf16")


def test_update_collections_keeps_container_type():
    from flax.core.frozen_dict import FrozenDict

    merged = update_collections({"fp8_metas": 2}, FrozenDict({"params": 1, "fp8_metas": 0}))
    assert isinstance(merged, FrozenDict) and dict(merged) == {"params": 1, "fp8_metas": 2}
    assert update_collections({"a": 1}, {"b": 2}) == {"b": 2, "a": 1}
    with pytest.raises(TypeError, match="original must be a dict"):
        update_collections({}, [("params", 1)])
