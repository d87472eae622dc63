"""OpRegistry and OpImpl: idempotent, checked, atomic registration; override; unregister; queries."""

import threading

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, make_impl, make_manager, relu_impl
from transformer_engine.plugin.core import BackendImplKind, Capabilities, OpImpl, OpRegistry, RegistrationError
from transformer_engine.plugin.core.types import ArgKey


def test_the_seed_example_registers_and_dispatches():
    from transformer_engine.plugin.core import BackendImplKind, OpImpl, OpManager, OpRegistry

    def my_gelu(x):
        return ("x-gelu", x)

    registry = OpRegistry()
    registry.register(OpImpl(op_name="gelu", impl_id="vendor.x", kind=BackendImplKind.VENDOR, fn=my_gelu, vendor="x"))
    manager = OpManager(registry, load_builtins=False, discover=False)
    x = FakeTensor()
    assert manager.call("gelu", x) == ("x-gelu", x)
    assert manager.select("gelu", x).impl_id == "vendor.x"


# -- OpImpl ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, expected",
    [
        (BackendImplKind.DEFAULT, BackendImplKind.DEFAULT),
        ("flagos", BackendImplKind.DEFAULT),
        ("DEFAULT", BackendImplKind.DEFAULT),
        (" Reference ", BackendImplKind.REFERENCE),
        ("VENDOR", BackendImplKind.VENDOR),
    ],
)
def test_kind_is_parsed_from_names_and_values(kind, expected):
    impl = OpImpl("relu", "some.id", kind, relu_impl("t"), vendor="v")
    assert impl.kind is expected


def test_unknown_kind_raises_naming_the_choices():
    with pytest.raises(ValueError, match="unknown backend kind 'gpu'; expected one of flagos, vendor, reference"):
        OpImpl("relu", "x.y", "gpu", relu_impl("t"))


@pytest.mark.parametrize("kind, priority", [("flagos", 150), ("vendor", 100), ("reference", 50)])
def test_default_priorities(kind, priority):
    impl = OpImpl("relu", "a.b", kind, relu_impl("t"), vendor="v")
    assert impl.priority == priority == BackendImplKind.parse(kind).default_priority
    assert OpImpl("relu", "a.b", kind, relu_impl("t"), vendor="v", priority=7).priority == 7


def test_vendor_impl_needs_a_vendor_which_is_lower_cased():
    with pytest.raises(ValueError, match="must name its vendor"):
        OpImpl("relu", "vendor.x", "vendor", relu_impl("t"))
    with pytest.raises(ValueError, match="must name its vendor"):
        OpImpl("relu", "vendor.x", "vendor", relu_impl("t"), vendor="  ")
    assert OpImpl("relu", "vendor.x", "vendor", relu_impl("t"), vendor=" CUDA ").vendor == "cuda"


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(op_name=""), ValueError, "non-empty op_name and impl_id"),
        (dict(impl_id=""), ValueError, "non-empty op_name and impl_id"),
        (dict(fn=42), TypeError, "fn is not callable"),
        (dict(supports="yes"), TypeError, "supports must be callable"),
        (dict(capabilities={"device_types": {"cuda"}}), TypeError, "Capabilities instance"),
    ],
)
def test_opimpl_rejects_bad_fields(fields, error, match):
    args = dict(op_name="relu", impl_id="reference.t", kind="reference", fn=relu_impl("t"))
    args.update(fields)
    with pytest.raises(error, match=match):
        OpImpl(**args)


def test_capabilities_normalise_device_and_dtype_names():
    caps = Capabilities(device_types=["CUDA"], dtypes=["torch.bfloat16", "float16"], min_compute_capability=("9", 0))
    assert caps.device_types == {"cuda"} and caps.dtypes == {"bfloat16", "float16"}
    assert caps.min_compute_capability == (9, 0)


def test_capabilities_accept_torch_dtype_objects():
    torch = pytest.importorskip("torch")
    assert Capabilities(dtypes={torch.float8_e4m3fn}).dtypes == {"float8_e4m3fn"}


@pytest.mark.parametrize(
    "key, cc, reason",
    [
        (ArgKey("cpu", None, "float32"), None, "device 'cpu' not in ['cuda']"),
        (ArgKey("cuda", 0, "float64"), (9, 0), "dtype 'float64' not in ['bfloat16', 'float16']"),
        (ArgKey("cuda", 0, "float16"), (8, 6), "needs compute capability >= 8.9, device has 8.6"),
        (ArgKey("cuda", 0, "float16"), (8, 9), None),
        (ArgKey("cuda", 0, "bfloat16"), None, None),  # unknown capability: not a reason to reject
        (ArgKey("cuda", 0, None), (9, 0), None),  # no dtype on the key argument: not checked
    ],
)
def test_capabilities_reject_reasons(key, cc, reason):
    caps = Capabilities(device_types={"cuda"}, dtypes={"bfloat16", "float16"}, min_compute_capability=(8, 9))
    assert caps.reject_reason(key, cc) == reason


def test_default_capabilities_accept_anything():
    assert Capabilities().reject_reason(ArgKey(None, None, None), None) is None


# -- registration ------------------------------------------------------------------------------
def test_registering_the_same_impl_twice_is_a_no_op():
    registry = OpRegistry()
    fn = relu_impl("vendor.acme")
    assert registry.register(make_impl("vendor.acme", fn)) is True
    epoch = registry.epoch
    assert registry.register(make_impl("vendor.acme", fn)) is False  # an equal, separately built OpImpl
    assert registry.register_many([make_impl("vendor.acme", fn)]) == 0
    assert registry.epoch == epoch
    assert len(registry.get_implementations("relu")) == 1


class _Backend:
    def __init__(self, tag):
        self.tag = tag

    def relu(self, x):
        return self.tag


def test_the_same_bound_method_is_idempotent_but_another_instance_conflicts():
    a, b = _Backend("a"), _Backend("b")
    registry = OpRegistry()
    registry.register(make_impl("vendor.acme", a.relu))
    assert registry.register(make_impl("vendor.acme", a.relu)) is False  # a new bound-method object, same method
    with pytest.raises(RegistrationError, match="already has a different impl"):
        registry.register(make_impl("vendor.acme", b.relu))


def test_a_different_impl_under_the_same_id_raises_unless_override():
    registry = OpRegistry()
    registry.register(make_impl("vendor.acme", relu_impl("old")))
    with pytest.raises(RegistrationError, match=r"op 'relu' already has a different impl 'vendor.acme'.*override=True"):
        registry.register(make_impl("vendor.acme", relu_impl("new")))
    with pytest.raises(RegistrationError):
        registry.register(make_impl("vendor.acme", registry.get_implementation("relu", "vendor.acme").fn, priority=1))
    epoch = registry.epoch
    assert registry.register(make_impl("vendor.acme", relu_impl("new")), override=True) is True
    assert registry.epoch == epoch + 1
    assert registry.get_implementation("relu", "vendor.acme").fn(None) == "new"


def test_register_impl_is_the_upstream_alias():
    registry = OpRegistry()
    assert registry.register_impl(make_impl("reference.torch")) is True
    assert registry.list_operators() == ["relu"]


def test_register_many_is_atomic_on_a_conflict():
    registry = OpRegistry()
    registry.register(make_impl("vendor.acme", relu_impl("old")))
    epoch = registry.epoch
    batch = [make_impl("reference.torch"), make_impl("flagos.triton"), make_impl("vendor.acme", relu_impl("new"))]
    with pytest.raises(RegistrationError):
        registry.register_many(batch)
    assert [i.impl_id for i in registry.get_implementations("relu")] == ["vendor.acme"]
    assert registry.epoch == epoch


def test_register_many_is_atomic_on_a_bad_signature():
    registry = OpRegistry()

    def bad(x, y):
        return x

    with pytest.raises(RegistrationError, match="signature"):
        registry.register_many([make_impl("reference.torch"), make_impl("vendor.acme", bad)])
    assert registry.list_operators() == [] and registry.epoch == 0


def test_two_different_impls_with_one_id_in_one_batch_raise():
    with pytest.raises(RegistrationError, match="two different impls of 'relu' with id 'vendor.acme' in one batch"):
        OpRegistry().register_many([make_impl("vendor.acme", relu_impl("1")), make_impl("vendor.acme", relu_impl("2"))])


def test_non_opimpl_is_a_type_error():
    with pytest.raises(TypeError, match="expected an OpImpl, got dict"):
        OpRegistry().register({"op_name": "relu"})


def _gelu_x_y(x, y):
    return x


def _gelu_renamed(inp):
    return inp


def _gelu_kwonly(*, x):
    return x


def _gelu_varargs(*args):
    return args


def _swiglu_other_default(x, limit=8.0, alpha=1.702):
    return x


def _swiglu_no_default(x, limit, alpha=1.702):
    return x


@pytest.mark.parametrize(
    "op, fn",
    [
        ("gelu", _gelu_x_y),
        ("gelu", _gelu_renamed),
        ("gelu", _gelu_kwonly),
        ("gelu", _gelu_varargs),
        ("clamped_swiglu", _swiglu_other_default),
        ("clamped_swiglu", _swiglu_no_default),
    ],
)
def test_signature_must_equal_the_catalog_declaration(op, fn):
    with pytest.raises(RegistrationError, match=rf"the impl of op '{op}' has signature .* but the catalog declares {op}\("):
        OpRegistry().register(make_impl("reference.torch", fn, op=op))


def test_a_matching_signature_with_defaults_is_accepted():
    def clamped_swiglu(x, limit=7.0, alpha=1.702):
        return x

    assert OpRegistry().register(make_impl("reference.torch", clamped_swiglu, op="clamped_swiglu"))


def test_unknown_op_raises_with_a_suggestion():
    with pytest.raises(RegistrationError, match=r"unknown op 'gelo'; did you mean gelu.*declare it in the catalog first"):
        OpRegistry().register(make_impl("reference.torch", op="gelo"))


# -- removal and queries -----------------------------------------------------------------------
def test_unregister_one_impl_and_a_whole_backend():
    registry = OpRegistry()
    registry.register_many([make_impl("vendor.acme"), make_impl("reference.torch"), make_impl("vendor.acme", op="gelu", fn=lambda x: x)])
    epoch = registry.epoch
    assert registry.unregister("relu", "reference.torch") is True
    assert registry.epoch == epoch + 1
    assert registry.unregister("relu", "reference.torch") is False
    assert registry.unregister("no_such_op", "x") is False
    assert registry.epoch == epoch + 1
    assert registry.unregister_backend("vendor.acme") == 2
    assert registry.unregister_backend("vendor.acme") == 0
    assert registry.list_operators() == [] and registry.impl_ids() == []


def test_clear_removes_everything_and_bumps_the_epoch():
    registry = OpRegistry()
    registry.register(make_impl("vendor.acme"))
    epoch = registry.epoch
    registry.clear()
    assert registry.list_operators() == [] and registry.epoch == epoch + 1


def test_queries_return_copies_in_registration_order():
    registry = OpRegistry()
    registry.register_many([make_impl("vendor.zed"), make_impl("reference.torch"), make_impl("flagos.triton")])
    registry.register(make_impl("vendor.acme", op="gelu", fn=lambda x: x))
    impls = registry.get_implementations("relu")
    assert [i.impl_id for i in impls] == ["vendor.zed", "reference.torch", "flagos.triton"]
    impls.clear()
    assert len(registry.get_implementations("relu")) == 3
    assert registry.get_implementations("gemm") == []
    assert registry.get_implementation("relu", "vendor.nope") is None
    assert registry.list_operators() == ["gelu", "relu"]
    assert registry.impl_ids() == ["flagos.triton", "reference.torch", "vendor.acme", "vendor.zed"]


def test_concurrent_registration_from_threads():
    registry = OpRegistry()
    shared = relu_impl("vendor.shared")
    barrier = threading.Barrier(8)
    errors = []

    def worker(i):
        try:
            barrier.wait(10)
            for j in range(25):
                registry.register(make_impl(f"vendor.t{i}x{j}"))
                registry.register(make_impl("vendor.shared", shared))  # every thread: the same impl
        except Exception as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(registry.get_implementations("relu")) == 8 * 25 + 1
    assert registry.epoch == 8 * 25 + 1  # idempotent re-registrations do not bump it


def test_registry_used_by_a_manager_sees_later_registrations():
    manager = make_manager(make_impl("reference.torch"))
    x = FakeTensor()
    assert manager.call("relu", x) == "reference.torch"
    manager.registry.register(make_impl("vendor.acme"))
    assert manager.call("relu", x) == "vendor.acme"
