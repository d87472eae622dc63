"""OpManager dispatch: plan caching and invalidation, call forms, generated dispatchers, what torch.compile traces."""

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, make_impl, make_manager, relu_impl, three_kinds
from transformer_engine.plugin._ops import OpNamespace
from transformer_engine.plugin.core import (
    Capabilities,
    FallbackWarning,
    NoImplementationError,
    Reject,
    SelectionPolicy,
    declare,
    reset_global_policy,
    set_global_policy,
    with_preference,
    with_strict_mode,
)
from transformer_engine.plugin.core.types import ArgKey

X = FakeTensor()


# -- caching and invalidation ------------------------------------------------------------------
def test_plans_are_cached_per_key():
    probes = []
    manager = make_manager(make_impl("reference.torch"))
    rank = manager.rank
    manager.rank = lambda *a, **k: probes.append(a) or rank(*a, **k)
    for _ in range(5):
        manager.call("relu", X)
        manager.call("relu", FakeTensor())  # another object, same device and dtype
    assert len(probes) == 1
    manager.call("relu", FakeTensor(dtype="bfloat16"))
    manager.call("relu", FakeTensor("cpu", index=3))
    manager.call("relu", FakeTensor("cuda", index=0))
    assert len(probes) == 4
    with with_strict_mode():
        manager.call("relu", X)
    assert len(probes) == 5
    manager.clear_cache()
    manager.call("relu", X)
    assert len(probes) == 6


def test_cache_distinguishes_dtype_with_torch_tensors():
    torch = pytest.importorskip("torch")

    def relu_bf16(x):
        return ("bf16", torch.relu(x))

    def relu_any(x):
        return ("any", torch.relu(x))

    manager = make_manager(
        make_impl("flagos.triton", relu_bf16, capabilities=Capabilities(dtypes={torch.bfloat16})),
        make_impl("reference.torch", relu_any),
    )
    x32 = torch.tensor([-1.0, 2.0])
    for _ in range(2):
        tag, y = manager.call("relu", x32)
        assert tag == "any" and torch.equal(y, torch.tensor([0.0, 2.0]))
        assert manager.call("relu", x32.bfloat16())[0] == "bf16"


def test_policy_change_invalidates_the_choice_and_scope_exit_restores_it(monkeypatch):
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    with with_preference("reference"):
        assert manager.call("relu", X) == "reference.torch"
    assert manager.call("relu", X) == "flagos.triton"
    set_global_policy(SelectionPolicy(prefer="vendor"))
    assert manager.call("relu", X) == "vendor.acme"
    monkeypatch.setenv("TE_FL_PREFER", "reference")
    reset_global_policy()
    assert manager.call("relu", X) == "reference.torch"


def test_registry_changes_invalidate_the_choice():
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    manager.registry.unregister("relu", "flagos.triton")
    assert manager.call("relu", X) == "vendor.acme"
    manager.registry.register(make_impl("vendor.acme", relu_impl("replaced")), override=True)
    assert manager.call("relu", X) == "replaced"
    manager.registry.clear()
    with pytest.raises(NoImplementationError):
        manager.call("relu", X)


def test_reload_forgets_registrations():
    manager = three_kinds()
    manager.call("relu", X)
    manager.reload()
    assert manager.registry.list_operators() == []
    with pytest.raises(NoImplementationError):
        manager.call("relu", X)


# -- call forms --------------------------------------------------------------------------------
def test_key_argument_by_keyword_and_other_arguments_passed_through():
    seen = []

    def clamped_swiglu(x, limit=7.0, alpha=1.702):
        seen.append((x, limit, alpha))
        return "ok"

    manager = make_manager(make_impl("reference.torch", clamped_swiglu, op="clamped_swiglu"))
    assert manager.call("clamped_swiglu", x=X) == "ok"
    assert manager.call("clamped_swiglu", X, alpha=2.0) == "ok"
    assert manager.call("clamped_swiglu", X, 3.0, 4.0) == "ok"
    assert seen == [(X, 7.0, 1.702), (X, 7.0, 2.0), (X, 3.0, 4.0)]


def test_key_argument_that_is_not_the_first_parameter():
    manager = make_manager(
        make_impl("flagos.triton", lambda dy, x: "gpu", op="dgelu", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("reference.torch", lambda dy, x: "any", op="dgelu"),
    )
    assert manager.call("dgelu", FakeTensor("cpu"), FakeTensor("cuda", index=0)) == "any"  # key is dy
    assert manager.call("dgelu", FakeTensor("cuda", index=0), FakeTensor("cpu")) == "gpu"


@pytest.mark.parametrize("key", [None, 3.5, "text", [], [[]]])
def test_key_argument_without_device_or_dtype(key):
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme", capabilities=Capabilities(dtypes={"bfloat16"})),
        make_impl("reference.torch"),
    )
    # a device limit cannot be proven for a key without a device; a missing dtype is not checked
    assert manager.call("relu", key) == "vendor.acme"
    reasons = {d.impl_id: d.reason for d in manager.explain("relu", key)}
    assert reasons["flagos.triton"] == "device None not in ['cuda']"


def test_list_key_is_described_by_its_first_tensor():
    def gpu_scale(chunk_size, noop_flag, tensor_lists, scale):
        return "gpu"

    def any_scale(chunk_size, noop_flag, tensor_lists, scale):
        return "any"

    manager = make_manager(
        make_impl("flagos.triton", gpu_scale, op="multi_tensor_scale", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("reference.torch", any_scale, op="multi_tensor_scale"),
    )
    on_gpu = FakeTensor("cuda", index=0)
    assert manager.call("multi_tensor_scale", 64, None, [[on_gpu], [on_gpu]], 1.0) == "gpu"
    assert manager.call("multi_tensor_scale", 64, None, [[X], [X]], 1.0) == "any"


def test_wrong_arguments_raise_type_error_before_any_impl_runs():
    calls = []
    manager = make_manager(make_impl("reference.torch", relu_impl("r", calls=calls)))
    with pytest.raises(TypeError):
        manager.call("relu", X, X)
    with pytest.raises(TypeError):
        manager.call("relu", y=X)
    assert calls == []


def test_dispatcher_carries_the_op_signature_and_doc():
    import inspect

    from transformer_engine.plugin.core import get_spec

    manager = make_manager()
    dispatch = manager.dispatcher("layernorm_fwd")
    spec = get_spec("layernorm_fwd")
    assert dispatch.__name__ == "layernorm_fwd" and dispatch.__doc__ == spec.doc
    assert inspect.signature(dispatch) == spec.signature and dispatch.spec is spec
    assert manager.dispatcher("layernorm_fwd") is dispatch


def test_ops_namespace_dispatches_and_traces():
    manager = three_kinds(always_fail=True)
    ops = OpNamespace(manager)
    assert "relu" in dir(ops) and ops.relu.spec.name == "relu"
    with pytest.warns(FallbackWarning):
        result, impl = ops.relu.traced(X)
    assert (result, impl.impl_id) == ("vendor.acme", "vendor.acme")
    assert ops.relu(X) == "vendor.acme"


def test_ops_namespace_finds_ops_declared_later(restore_catalog):
    manager = make_manager()
    ops = OpNamespace(manager)

    @declare
    def tefl_test_late_op(x):
        """y = x."""

    manager.registry.register(make_impl("reference.torch", lambda x: "late", op="tefl_test_late_op"))
    assert ops.tefl_test_late_op(X) == "late"
    with pytest.raises(AttributeError):
        ops._private


def test_select_resolve_and_call_impl():
    manager = three_kinds()
    assert manager.select("relu", X).impl_id == "flagos.triton"
    assert manager.resolve("relu", X)(X) == "flagos.triton"
    assert manager.call_impl("relu", "reference.torch", X) == "reference.torch"
    with pytest.raises(NoImplementationError, match="backend 'vendor.nope' has no implementation of op 'relu'"):
        manager.call_impl("relu", "vendor.nope", X)


def test_select_with_every_candidate_declining_explains():
    manager = make_manager(make_impl("reference.torch", supports=lambda x: Reject("never")))
    with pytest.raises(NoImplementationError, match="reference.torch: never"):
        manager.select("relu", X)


def test_call_traced_reports_the_impl_that_actually_ran():
    manager = make_manager(
        make_impl("flagos.triton", relu_impl("flagos.triton", fail_on_bad=True)),
        make_impl("vendor.acme", supports=lambda x: False),
        make_impl("reference.torch"),
    )
    assert manager.call_traced("relu", X)[1].impl_id == "flagos.triton"
    with pytest.warns(FallbackWarning):
        result, impl = manager.call_traced("relu", FakeTensor(bad=True))
    assert result == impl.impl_id == "reference.torch"
    with with_strict_mode(), pytest.raises(RuntimeError):
        manager.call_traced("relu", FakeTensor(bad=True))


# -- generated dispatchers for any parameter kind ----------------------------------------------
def test_every_parameter_kind_is_forwarded_including_on_fallback(restore_catalog):
    @declare
    def tefl_test_kinds(x, /, y, *rest, scale=2.0, **extra):
        """z = (x, y, rest, scale, extra)."""

    def failing(x, /, y, *rest, scale=2.0, **extra):
        raise ValueError("first impl fails")

    def echo(x, /, y, *rest, scale=2.0, **extra):
        return (y, rest, scale, extra)

    manager = make_manager(
        make_impl("flagos.triton", failing, op="tefl_test_kinds"),
        make_impl("reference.torch", echo, op="tefl_test_kinds"),
    )
    with pytest.warns(FallbackWarning, match="first impl fails"):
        assert manager.call("tefl_test_kinds", X, 1, 2, 3, scale=4.0, flag=True) == (1, (2, 3), 4.0, {"flag": True})
    assert manager.call("tefl_test_kinds", X, y=5) == (5, (), 2.0, {})
    with pytest.raises(TypeError):
        manager.call("tefl_test_kinds", x=X, y=1)  # x is positional-only


def test_a_parameter_name_reserved_by_the_dispatcher_is_refused(restore_catalog):
    from transformer_engine.plugin.core import CatalogError

    @declare
    def tefl_test_reserved(x, _te_plan=None):
        """y = x."""

    with pytest.raises(CatalogError, match="'_te_plan': names starting with '_te_' are reserved"):
        make_manager().dispatcher("tefl_test_reserved")


# -- what torch.compile traces ------------------------------------------------------------------
def _form_tags(manager):
    """compiled_form of relu on a CPU float32 key, as (has a predicate, the tag its fn returns) pairs."""
    return [(supports is not None, fn(X)) for supports, fn in manager.compiled_form("relu", ArgKey("cpu", None, "float32"))]


def test_compiled_form_traces_the_reference_in_place_of_a_triton_kernel():
    manager = make_manager(make_impl("flagos.triton", under_compile="reference"), make_impl("reference.torch", under_compile="trace"))
    assert _form_tags(manager) == [(False, "reference.torch")]


def test_compiled_form_walks_traceable_impls_with_predicates_in_policy_order():
    manager = make_manager(
        make_impl("vendor.acme", under_compile="trace", supports=lambda x: True),
        make_impl("flagos.triton", under_compile="reference"),
        make_impl("reference.torch", under_compile="trace"),
    )
    with with_preference("vendor"):
        assert _form_tags(manager) == [(True, "vendor.acme"), (False, "reference.torch")]
    with with_preference("reference"):
        assert _form_tags(manager) == [(False, "reference.torch")]


def test_compiled_form_keeps_an_opaque_backend_opaque():
    """An out-of-tree backend (under_compile defaults to custom_op) ahead of the reference: nothing is
    traced in its place, the op stays a custom op that dispatches to it when it runs."""
    manager = make_manager(make_impl("vendor.acme"), make_impl("reference.torch", under_compile="trace"))
    assert _form_tags(manager) == []
    with with_preference("reference"):
        assert _form_tags(manager) == [(False, "reference.torch")]


def test_under_compile_must_be_a_known_value():
    with pytest.raises(ValueError, match="under_compile='inline' must be one of"):
        make_impl("vendor.acme", under_compile="inline")
