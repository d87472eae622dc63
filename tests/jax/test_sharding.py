"""MeshResource roles, TE's logical axes, and TransformerLayer on a 4-device CPU mesh vs one device.

The 4 host devices come from ``--xla_force_host_platform_device_count=4``, set by tests/jax/conftest.py
before JAX starts.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.jax import sharding

from ._utils import assert_allclose, randn, unbox

CPU = jax.devices("cpu")
needs_4 = pytest.mark.skipif(len(CPU) < 4, reason="needs 4 CPU devices (XLA_FLAGS set before JAX initialised)")


def _mesh(shape, names):
    return Mesh(np.array(CPU[: int(np.prod(shape))]).reshape(shape), names)


def test_no_mesh_means_no_constraints_and_no_rules():
    x = jnp.ones((2, 3))
    assert sharding.with_sharding_constraint_by_logical_axes(x, (sharding.BATCH_AXES, None)) is x
    assert sharding.get_sharding_map_logic_axis_to_mesh_axis() == {}
    assert sharding.extend_logical_axis_rules((("embed", None),)) == (("embed", None),)
    with pytest.raises(ValueError, match="one name"):
        sharding.with_sharding_constraint_by_logical_axes(x, (sharding.BATCH_AXES,))


@needs_4
def test_role_mapping_and_errors():
    mesh = _mesh((2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        with te.autocast(mesh_resource=te.MeshResource(fsdp_resource="data", tpsp_resource="model")):
            table = sharding.get_sharding_map_logic_axis_to_mesh_axis()
            assert table[sharding.BATCH_AXES] == "data" and table[sharding.W_FSDP_AXES] == "data"
            assert table[sharding.HEAD_AXES] == "model" and table[sharding.SEQLEN_TP_AXES] == "model"
            assert table[sharding.W_JOINED_AXES] is None
            with pytest.raises(ValueError, match="maps to"):
                sharding.extend_logical_axis_rules(((sharding.BATCH_AXES, "model"),))
        with te.autocast(mesh_resource=te.MeshResource(dp_resource="batch")):
            with pytest.raises(ValueError, match="'batch' is not in the mesh"):
                sharding.get_sharding_map_logic_axis_to_mesh_axis()
        with te.autocast(mesh_resource=te.MeshResource(tp_resource="data", tpsp_resource="model")):
            with pytest.raises(ValueError, match="both have more than one device"):
                sharding.global_mesh_resource()
        with pytest.raises(RuntimeError, match="no MeshResource"):
            sharding.global_mesh_resource()


X = randn(0, (4, 8, 32))
DY = randn(1, (4, 8, 32))
RECIPE = DelayedScaling(amax_history_len=4)


def _layer():
    return te_flax.TransformerLayer(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4,
                                    hidden_dropout=0.0, attention_dropout=0.0)


def _loss(layer, variables, x):
    return jnp.sum(layer.apply(variables, x, deterministic=True) * DY)


@functools.lru_cache(maxsize=None)
def _single(fp8: bool):
    """(variables, loss, grads) of one jitted train step on one device (computed once per recipe)."""
    with te.autocast(enabled=fp8, recipe=RECIPE):
        layer = _layer()
        variables = jax.jit(lambda: layer.init(jax.random.PRNGKey(1), X, deterministic=True))()
        loss, grads = jax.jit(jax.value_and_grad(lambda v, x: _loss(layer, v, x)))(variables, X)
        return variables, loss, grads


def _sharded(fp8: bool, mesh, resource):
    """The same step with parameters sharded by TE's logical axes; returns (loss, grads, variables, hlo)."""
    with jax.set_mesh(mesh), te.autocast(enabled=fp8, recipe=RECIPE, mesh_resource=resource):
        rules = te_flax.extend_logical_axis_rules(())
        with nn.logical_axis_rules(rules):
            layer = _layer()
            variables = _single(fp8)[0]
            shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)
            variables = jax.device_put(variables, shardings)
            batch_axis = resource.fsdp_resource or resource.dp_resource
            x = jax.device_put(X, NamedSharding(mesh, PartitionSpec(batch_axis)))
            step = jax.jit(jax.value_and_grad(lambda v, x: _loss(layer, v, x)), out_shardings=(None, shardings))
            compiled = step.lower(variables, x).compile()
            loss, grads = compiled(variables, x)
            return loss, grads, variables, compiled.as_text()


LAYOUTS = {
    "dp": ((4,), ("dp",), te.MeshResource(dp_resource="dp")),
    "fsdp": ((2, 2), ("dp", "fsdp"), te.MeshResource(dp_resource="dp", fsdp_resource="fsdp")),
    "dp_tp": ((2, 2), ("dp", "tp"), te.MeshResource(dp_resource="dp", tp_resource="tp")),
}
EXPECTED_QKV_SPEC = {"dp": (None, None, None), "fsdp": ("fsdp", None, None), "dp_tp": (None, None, "tp")}


@needs_4
@pytest.mark.parametrize("layout,fp8", [("dp", True), ("fsdp", True), ("dp_tp", True), ("dp_tp", False)])
def test_sharded_transformer_layer_equals_single_device(layout, fp8):
    shape, names, resource = LAYOUTS[layout]
    _, loss0, grads0 = _single(fp8)
    loss1, grads1, variables, hlo = _sharded(fp8, _mesh(shape, names), resource)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-5)
    leaves0, leaves1 = (jax.tree_util.tree_leaves(unbox(g)) for g in (grads0, grads1))
    assert len(leaves0) == len(leaves1) == (33 if fp8 else 9)  # 9 parameters (+ 4 GEMMs x 6 FP8 variables)
    for g0, g1 in zip(leaves0, leaves1):
        assert_allclose(g1, g0, jnp.float32, normalize=True)  # parameter grads and the next fp8_metas
    kernel_spec = tuple(unbox(variables)["params"]["attention"]["qkv"]["kernel"].sharding.spec)
    assert kernel_spec + (None,) * (3 - len(kernel_spec)) == EXPECTED_QKV_SPEC[layout]
    assert "all-reduce" in hlo  # gradients (dp, fsdp) or partial sums (tp) are reduced across devices
