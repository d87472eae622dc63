"""OpManager: ordering, priority, capabilities, strict vs fallback, caching, call forms, explanations."""

import logging
import warnings

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
    get_policy,
    policy_context,
    reset_global_policy,
    set_global_policy,
    with_allowed_vendors,
    with_denied_vendors,
    with_preference,
    with_strict_mode,
)
from transformer_engine.plugin.core.types import ArgKey

X = FakeTensor()


def _order(manager, op="relu", x=X):
    return [d.impl_id for d in manager.explain(op, x) if d.status != "rejected"]


# -- ordering and priority ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefer, order",
    [
        ("flagos", ["flagos.triton", "vendor.acme", "reference.torch"]),
        ("vendor", ["vendor.acme", "flagos.triton", "reference.torch"]),
        ("reference", ["reference.torch", "flagos.triton", "vendor.acme"]),
    ],
)
def test_prefer_orders_the_kinds(prefer, order):
    manager = three_kinds()
    with with_preference(prefer):
        assert _order(manager) == order
        assert manager.call("relu", X) == order[0]


def test_kind_order_beats_priority():
    manager = make_manager(make_impl("vendor.acme", priority=10_000), make_impl("flagos.triton", priority=1))
    assert manager.call("relu", X) == "flagos.triton"


def test_priority_orders_inside_a_kind_then_impl_id():
    manager = make_manager(
        make_impl("vendor.b", priority=100),
        make_impl("vendor.a", priority=100),
        make_impl("vendor.c", priority=300),
    )
    with with_preference("vendor"):
        assert _order(manager) == ["vendor.c", "vendor.a", "vendor.b"]


def test_a_plugin_takes_over_an_op_by_priority():
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    manager.registry.register(make_impl("flagos.myplugin", priority=200))
    assert manager.call("relu", X) == "flagos.myplugin"
    assert _order(manager)[:2] == ["flagos.myplugin", "flagos.triton"]


@pytest.mark.parametrize("per_op", ["relu=impl:vendor.acme", "relu=vendor:ACME", "relu = Vendor:acme "])
def test_a_plugin_takes_over_an_op_through_te_fl_per_op(monkeypatch, per_op):
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    monkeypatch.setenv("TE_FL_PER_OP", per_op)
    reset_global_policy()
    assert manager.call("relu", X) == "vendor.acme"
    assert _order(manager) == ["vendor.acme", "flagos.triton", "reference.torch"]


def test_vendor_names_match_case_insensitively():
    manager = make_manager(make_impl("vendor.CUDA", vendor="CUDA"), make_impl("reference.torch"))
    with policy_context(SelectionPolicy(per_op_order={"relu": "vendor:cuda|only"})):
        assert manager.call("relu", X) == "vendor.CUDA"
    with with_denied_vendors("Cuda"):
        assert manager.call("relu", X) == "reference.torch"


def test_per_op_order_keeps_the_default_order_as_tail():
    manager = three_kinds()
    with policy_context(SelectionPolicy(per_op_order={"relu": "reference"})):
        assert _order(manager) == ["reference.torch", "flagos.triton", "vendor.acme"]


def test_only_marker_excludes_the_rest_with_a_reason():
    manager = three_kinds()
    with policy_context(SelectionPolicy(per_op_order={"relu": "reference|only"})):
        decisions = {d.impl_id: d for d in manager.explain("relu", X)}
    assert decisions["reference.torch"].status == "selected"
    for other in ("flagos.triton", "vendor.acme"):
        assert decisions[other].status == "rejected"
        assert decisions[other].reason == "not named by the exclusive per-op order"


def test_impl_token_naming_an_absent_impl_falls_through_to_the_tail():
    manager = three_kinds()
    with policy_context(SelectionPolicy(per_op_order={"relu": "impl:vendor.nothere"})):
        assert manager.call("relu", X) == "flagos.triton"


# -- vendor filter and capabilities -------------------------------------------------------------
def test_allow_and_deny_lists_with_reasons():
    manager = three_kinds()
    with with_preference("vendor"):
        with with_denied_vendors("ACME"):
            assert manager.call("relu", X) == "flagos.triton"
            assert "denied" in {d.impl_id: d for d in manager.explain("relu", X)}["vendor.acme"].reason
        with with_allowed_vendors("other"):
            assert manager.call("relu", X) == "flagos.triton"
            assert "allow list" in {d.impl_id: d for d in manager.explain("relu", X)}["vendor.acme"].reason
        with with_allowed_vendors("Acme"):
            assert manager.call("relu", X) == "vendor.acme"


def test_capabilities_filter_by_device_and_dtype():
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme", capabilities=Capabilities(dtypes={"bfloat16"})),
        make_impl("reference.torch"),
    )
    assert manager.call("relu", FakeTensor("cpu", "float32")) == "reference.torch"
    assert manager.call("relu", FakeTensor("cpu", "bfloat16")) == "vendor.acme"
    assert manager.call("relu", FakeTensor("cuda", "float32", 0)) == "flagos.triton"
    reasons = {d.impl_id: d.reason for d in manager.explain("relu", FakeTensor("cpu", "float32"))}
    assert reasons["flagos.triton"] == "device 'cpu' not in ['cuda']"
    assert reasons["vendor.acme"] == "dtype 'float32' not in ['bfloat16']"


def test_min_compute_capability_is_checked_per_device_index(fake_gpu_probe):
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(min_compute_capability=(8, 9))),
        make_impl("reference.torch"),
    )
    assert manager.call("relu", FakeTensor(fake_gpu_probe, index=0)) == "flagos.triton"
    assert manager.call("relu", FakeTensor(fake_gpu_probe, index=1)) == "reference.torch"
    assert manager.call("relu", FakeTensor(fake_gpu_probe, index=0)) == "flagos.triton"
    reason = {d.impl_id: d.reason for d in manager.explain("relu", FakeTensor(fake_gpu_probe, index=1))}["flagos.triton"]
    assert reason == "needs compute capability >= 8.9, device has 8.0"


def test_supports_predicate_passes_the_call_on_with_its_reason():
    def only_good(x):
        return Reject("x is bad") if x.bad else True

    manager = make_manager(
        make_impl("flagos.triton", supports=only_good),
        make_impl("vendor.acme", supports=lambda x: False),
        make_impl("reference.torch"),
    )
    assert manager.call("relu", FakeTensor()) == "flagos.triton"
    bad = FakeTensor(bad=True)
    assert manager.call("relu", bad) == "reference.torch"
    assert manager.select("relu", bad).impl_id == "reference.torch"
    decisions = {d.impl_id: (d.status, d.reason) for d in manager.explain("relu", bad)}
    assert decisions == {
        "flagos.triton": ("rejected", "x is bad"),
        "vendor.acme": ("rejected", "supports() declined these arguments"),
        "reference.torch": ("selected", "first accepting candidate"),
    }


def test_no_implementation_error_names_every_reason():
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme", supports=lambda x: Reject("odd sizes unsupported")),
    )
    with with_denied_vendors("acme"):
        with pytest.raises(NoImplementationError, match=r"(?s)op 'relu' can run for cpu / float32.*flagos.triton: device 'cpu'.*vendor.acme: vendor 'acme' is denied"):
            manager.call("relu", X)
    with pytest.raises(NoImplementationError, match=r"(?s)flagos.triton: device.*vendor.acme: odd sizes unsupported"):
        manager.call("relu", X)


def test_op_without_any_impl():
    manager = make_manager(make_impl("reference.torch"))
    with pytest.raises(NoImplementationError, match=r"op 'gelu' can run.*\n  \(no backend implements it\)"):
        manager.call("gelu", X)


def test_unknown_op_name():
    manager = make_manager()
    with pytest.raises(KeyError, match="unknown op 'rellu'; did you mean relu"):
        manager.call("rellu", X)
    with pytest.raises(AttributeError, match="rellu"):
        OpNamespace(manager).rellu


# -- strict vs fallback ------------------------------------------------------------------------
def test_fallback_runs_the_next_candidate_and_warns_once_per_error_type():
    manager = three_kinds(always_fail=True)
    with pytest.warns(FallbackWarning, match=r"flagos.triton failed on op 'relu' \(RuntimeError: flagos.triton cannot do this\)"):
        assert manager.call("relu", X) == "vendor.acme"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager.call("relu", X) == "vendor.acme"


@pytest.mark.parametrize("how", ["context", "env", "global"])
def test_strict_mode_propagates_the_error(monkeypatch, how):
    manager = three_kinds(always_fail=True)
    if how == "env":
        monkeypatch.setenv("TE_FL_STRICT", "1")
        reset_global_policy()
        scope = policy_context(get_policy())
    elif how == "global":
        set_global_policy(SelectionPolicy(strict=True))
        scope = policy_context(get_policy())
    else:
        scope = with_strict_mode()
    with scope, warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="flagos.triton cannot do this"):
            manager.call("relu", X)


def test_strict_zero_means_fallback(monkeypatch):
    monkeypatch.setenv("TE_FL_STRICT", "0")
    reset_global_policy()
    manager = three_kinds(always_fail=True)
    with pytest.warns(FallbackWarning):
        assert manager.call("relu", X) == "vendor.acme"


def test_strict_mode_with_a_supports_predicate_still_skips_declined_impls():
    manager = make_manager(make_impl("flagos.triton", supports=lambda x: False), make_impl("reference.torch", relu_impl("r", always_fail=True)))
    with with_strict_mode(), pytest.raises(RuntimeError, match="r cannot do this"):
        manager.call("relu", X)


def test_a_head_with_a_predicate_that_accepts_then_raises_falls_back_unless_strict():
    calls = []

    def accepts(x):
        calls.append("supports")
        return True

    manager = make_manager(
        make_impl("flagos.triton", relu_impl("flagos.triton", fail_on_bad=True, calls=calls), supports=accepts),
        make_impl("vendor.acme", supports=lambda x: Reject("never")),
        make_impl("reference.torch", relu_impl("reference.torch", calls=calls)),
    )
    assert manager.call("relu", X) == "flagos.triton"
    with pytest.warns(FallbackWarning, match="flagos.triton failed"):
        assert manager.call("relu", FakeTensor(bad=True)) == "reference.torch"
    with with_strict_mode(), pytest.raises(RuntimeError, match="flagos.triton cannot do this"):
        manager.call("relu", FakeTensor(bad=True))
    assert calls == ["supports", "flagos.triton"] + ["supports", "flagos.triton", "reference.torch"] + ["supports", "flagos.triton"]


def test_a_lone_head_with_a_predicate_raises_its_own_error_or_its_reason():
    manager = make_manager(make_impl("flagos.triton", relu_impl("flagos.triton", fail_on_bad=True), supports=lambda x: x.dtype == "float32" or Reject("float32 only")))
    with pytest.warns(FallbackWarning), pytest.raises(RuntimeError, match="flagos.triton cannot do this"):
        manager.call("relu", FakeTensor(bad=True))
    with pytest.raises(NoImplementationError, match="flagos.triton: float32 only"):
        manager.call("relu", FakeTensor(dtype="float16"))


def test_when_every_candidate_fails_the_first_error_is_raised():
    manager = make_manager(
        make_impl("flagos.triton", relu_impl("first", always_fail=True)),
        make_impl("reference.torch", relu_impl("second", always_fail=True)),
    )
    with pytest.warns(FallbackWarning), pytest.raises(RuntimeError, match="first cannot do this"):
        manager.call("relu", X)


def test_fallback_is_not_sticky():
    calls = []
    manager = make_manager(
        make_impl("flagos.triton", relu_impl("flagos.triton", fail_on_bad=True, calls=calls)),
        make_impl("reference.torch", relu_impl("reference.torch", calls=calls)),
    )
    with pytest.warns(FallbackWarning):
        assert manager.call("relu", FakeTensor(bad=True)) == "reference.torch"
    assert manager.call("relu", FakeTensor()) == "flagos.triton"  # the good call runs on the first impl again
    assert calls == ["flagos.triton", "reference.torch", "flagos.triton"]


def test_in_place_ops_are_never_retried_on_another_impl():
    calls = []

    def failing(chunk_size, noop_flag, tensor_lists, scale):
        calls.append("flagos")
        raise RuntimeError("half-written outputs")

    def ok(chunk_size, noop_flag, tensor_lists, scale):
        calls.append("reference")

    manager = make_manager(
        make_impl("flagos.triton", failing, op="multi_tensor_scale"),
        make_impl("reference.torch", ok, op="multi_tensor_scale"),
    )
    with pytest.raises(RuntimeError, match="half-written outputs"):
        manager.call("multi_tensor_scale", 1024, None, [[X], [X]], 2.0)
    assert calls == ["flagos"]


def test_fallback_for_an_op_with_a_single_candidate_raises_the_impl_error():
    manager = make_manager(make_impl("reference.torch", relu_impl("only", always_fail=True)))
    with pytest.raises(RuntimeError, match="only cannot do this"):
        manager.call("relu", X)


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


# -- explain / describe ------------------------------------------------------------------------
def test_explain_lists_selected_fallbacks_and_rejections():
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme"),
        make_impl("reference.torch"),
    )
    decisions = manager.explain("relu", X)
    assert [(d.impl_id, d.kind, d.priority, d.status) for d in decisions] == [
        ("vendor.acme", "vendor", 100, "selected"),
        ("reference.torch", "reference", 50, "fallback"),
        ("flagos.triton", "flagos", 150, "rejected"),
    ]


def test_describe_gives_every_declared_op_a_row_list():
    manager = make_manager(
        make_impl("flagos.triton", capabilities=Capabilities(device_types={"cuda"})),
        make_impl("vendor.acme", supports=lambda x: True),
        make_impl("reference.torch"),
    )
    from transformer_engine.plugin.core import list_specs

    table = manager.describe("cpu")
    assert set(table) == {spec.name for spec in list_specs()}
    assert table["gemm"] == []
    rows = {d.impl_id: d for d in table["relu"]}
    # without arguments a supports() predicate cannot be run: that candidate is conditional and the
    # next unconditional one is the selected one
    assert rows["vendor.acme"].status == "conditional" and "supports()" in rows["vendor.acme"].reason
    assert rows["reference.torch"].status == "selected"
    assert rows["flagos.triton"].status == "rejected" and "device 'cpu'" in rows["flagos.triton"].reason
    assert [d.status for d in manager.describe("cuda")["relu"]] == ["selected", "fallback", "fallback"]


def test_describe_by_dtype():
    manager = make_manager(make_impl("flagos.triton", capabilities=Capabilities(dtypes={"bfloat16"})), make_impl("reference.torch"))
    assert manager.describe("cpu", "bfloat16")["relu"][0].impl_id == "flagos.triton"
    assert manager.describe("cpu", "float32")["relu"][0].impl_id == "reference.torch"


# -- initialisation ----------------------------------------------------------------------------
def test_unknown_op_in_te_fl_per_op_is_reported_at_initialisation(monkeypatch):
    monkeypatch.setenv("TE_FL_PER_OP", "not_an_op=reference;relu=vendor")
    reset_global_policy()
    manager = make_manager(make_impl("vendor.acme"))
    with pytest.warns(UserWarning, match="TE_FL_PER_OP names unknown op 'not_an_op'"):
        assert manager.call("relu", X) == "vendor.acme"


@pytest.fixture
def plugin_logger():
    logger = logging.getLogger("transformer_engine.plugin")
    level = logger.level
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.setLevel(level)


def test_te_fl_log_level_sets_the_plugin_logger_level(monkeypatch, plugin_logger):
    make_manager().ensure_initialized()
    assert plugin_logger.level == logging.NOTSET  # unset: the application's logging config decides
    monkeypatch.setenv("TE_FL_LOG_LEVEL", "debug")
    make_manager().ensure_initialized()
    assert plugin_logger.level == logging.DEBUG


def test_te_fl_log_level_bad_value_warns_and_leaves_the_logger_alone(monkeypatch, plugin_logger):
    from transformer_engine.plugin.core import PolicyConfigWarning

    monkeypatch.setenv("TE_FL_LOG_LEVEL", "LOUD")
    with pytest.warns(PolicyConfigWarning, match=r"ignoring TE_FL_LOG_LEVEL='LOUD': expected one of"):
        make_manager().ensure_initialized()
    assert plugin_logger.level == logging.NOTSET


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


def test_package_level_explain_and_describe_use_the_default_manager(monkeypatch):
    import transformer_engine.plugin as plugin

    manager = three_kinds()
    monkeypatch.setattr(plugin, "get_default_manager", lambda: manager)
    assert plugin.explain("relu", X) == manager.explain("relu", X)
    assert plugin.describe("cpu")["relu"] == manager.describe("cpu")["relu"]


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
