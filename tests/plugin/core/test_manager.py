"""OpManager selection: ordering, priority, vendor filter, capabilities, strict vs fallback."""

import warnings

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, explained_order, make_impl, make_manager, relu_impl, three_kinds
from transformer_engine.plugin._ops import OpNamespace
from transformer_engine.plugin.core import (
    Capabilities,
    FallbackWarning,
    NoImplementationError,
    Reject,
    SelectionPolicy,
    get_policy,
    policy_context,
    reset_global_policy,
    set_global_policy,
    with_allowed_vendors,
    with_denied_vendors,
    with_preference,
    with_strict_mode,
)

X = FakeTensor()


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
        assert explained_order(manager) == order
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
        assert explained_order(manager) == ["vendor.c", "vendor.a", "vendor.b"]


def test_a_plugin_takes_over_an_op_by_priority():
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    manager.registry.register(make_impl("flagos.myplugin", priority=200))
    assert manager.call("relu", X) == "flagos.myplugin"
    assert explained_order(manager)[:2] == ["flagos.myplugin", "flagos.triton"]


@pytest.mark.parametrize("per_op", ["relu=impl:vendor.acme", "relu=vendor:ACME", "relu = Vendor:acme "])
def test_a_plugin_takes_over_an_op_through_te_fl_per_op(monkeypatch, per_op):
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    monkeypatch.setenv("TE_FL_PER_OP", per_op)
    reset_global_policy()
    assert manager.call("relu", X) == "vendor.acme"
    assert explained_order(manager) == ["vendor.acme", "flagos.triton", "reference.torch"]


def test_vendor_names_match_case_insensitively():
    manager = make_manager(make_impl("vendor.CUDA", vendor="CUDA"), make_impl("reference.torch"))
    with policy_context(SelectionPolicy(per_op_order={"relu": "vendor:cuda|only"})):
        assert manager.call("relu", X) == "vendor.CUDA"
    with with_denied_vendors("Cuda"):
        assert manager.call("relu", X) == "reference.torch"


def test_per_op_order_keeps_the_default_order_as_tail():
    manager = three_kinds()
    with policy_context(SelectionPolicy(per_op_order={"relu": "reference"})):
        assert explained_order(manager) == ["reference.torch", "flagos.triton", "vendor.acme"]


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
        with pytest.raises(NoImplementationError,
                           match=r"(?s)op 'relu' can run for cpu / float32.*flagos.triton: device 'cpu'.*"
                                 r"vendor.acme: vendor 'acme' is denied"):
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
    manager = make_manager(make_impl("flagos.triton", supports=lambda x: False),
                           make_impl("reference.torch", relu_impl("r", always_fail=True)))
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
    manager = make_manager(make_impl("flagos.triton", relu_impl("flagos.triton", fail_on_bad=True),
                                     supports=lambda x: x.dtype == "float32" or Reject("float32 only")))
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


@pytest.mark.parametrize("head", ["unconditional", "predicate"])
def test_fallback_warnings_point_at_the_callers_line(head):
    supports = None if head == "unconditional" else (lambda x: True)
    manager = make_manager(
        make_impl("flagos.triton", relu_impl("flagos.triton", always_fail=True), supports=supports),
        make_impl("vendor.acme", relu_impl("vendor.acme", always_fail=True)),
        make_impl("reference.torch"),
    )
    with pytest.warns(FallbackWarning) as caught:
        assert OpNamespace(manager).relu(X) == "reference.torch"  # the dispatcher, as ops.relu
    assert [w.filename for w in caught] == [__file__, __file__]
    manager.clear_cache()  # forgets which failures were reported
    with pytest.warns(FallbackWarning) as caught:
        assert manager.call_traced("relu", X) == ("reference.torch", manager.registry.get_implementation("relu", "reference.torch"))
    assert [w.filename for w in caught] == [__file__, __file__]
