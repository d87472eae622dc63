"""SelectionPolicy: construction, orders, fingerprint, the global policy and the scoped overrides."""

import asyncio
import contextlib
import dataclasses
import threading

import pytest

from transformer_engine.plugin.core import (
    PolicyConfigWarning,
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
from transformer_engine.plugin.core.policy import DEFAULT_ORDERS, check_measured_per_op


# -- construction ------------------------------------------------------------------------------
def test_defaults():
    p = SelectionPolicy()
    assert (p.prefer, p.strict, p.per_op_order, p.allow_vendors, p.deny_vendors) == ("flagos", False, (), None, frozenset())


def test_prefer_is_normalised_and_validated():
    assert SelectionPolicy(prefer=" VENDOR ").prefer == "vendor"
    with pytest.raises(ValueError, match="'cuda' is not one of flagos, vendor, reference"):
        SelectionPolicy(prefer="cuda")


def test_vendor_sets_are_lower_cased():
    p = SelectionPolicy(allow_vendors={"CUDA", "Metax"}, deny_vendors=["HYGON"])
    assert p.allow_vendors == frozenset({"cuda", "metax"}) and p.deny_vendors == frozenset({"hygon"})


def test_per_op_order_from_a_mapping_or_strings_is_normalised_and_sorted():
    p = SelectionPolicy(per_op_order={"relu": "Vendor:ACME|reference", "gemm": ["impl:vendor.X", "ONLY"]})
    assert p.per_op_order == (("gemm", ("impl:vendor.X", "only")), ("relu", ("vendor:acme", "reference")))


@pytest.mark.parametrize("tokens, warns", [("bogus", True), (["flagos", "default"], True), ("", False), ("only", False)])
def test_per_op_order_with_a_bad_token_raises(tokens, warns):
    with pytest.warns(PolicyConfigWarning) if warns else contextlib.nullcontext():
        with pytest.raises(ValueError, match="invalid per-op order for 'relu'"):
            SelectionPolicy(per_op_order={"relu": tokens})


def test_policy_is_immutable_and_hashable():
    p = SelectionPolicy(prefer="vendor", deny_vendors={"x"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.prefer = "reference"
    q = SelectionPolicy(prefer="VENDOR", deny_vendors={"X"})
    assert p == q and hash(p) == hash(q) and p.fingerprint == q.fingerprint
    assert {p: 1}[q] == 1


@pytest.mark.parametrize(
    "change",
    [
        dict(prefer="reference"),
        dict(strict=True),
        dict(per_op_order={"relu": "reference"}),
        dict(per_op_order={"relu": "reference|only"}),
        dict(allow_vendors={"acme"}),
        dict(allow_vendors=frozenset()),
        dict(deny_vendors={"acme"}),
    ],
)
def test_every_field_changes_the_fingerprint(change):
    base = SelectionPolicy()
    other = SelectionPolicy(**change)
    assert other.fingerprint != base.fingerprint and other != base


def test_replace_recomputes_the_fingerprint():
    p = dataclasses.replace(SelectionPolicy(), strict=True)
    assert p.fingerprint == SelectionPolicy(strict=True).fingerprint != SelectionPolicy().fingerprint


def test_from_env_builds_every_field():
    env = {
        "TE_FL_PREFER": "vendor",
        "TE_FL_STRICT": "1",
        "TE_FL_PER_OP": "relu=reference",
        "TE_FL_ALLOW_VENDORS": "ACME",
        "TE_FL_DENY_VENDORS": "Evil",
    }
    assert SelectionPolicy.from_env(env) == SelectionPolicy(
        "vendor", strict=True, per_op_order=(("relu", ("reference",)),), allow_vendors=frozenset({"acme"}), deny_vendors=frozenset({"evil"})
    )


# -- orders and vendor filter ------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefer, order",
    [
        ("flagos", ("flagos", "vendor", "reference")),
        ("vendor", ("vendor", "flagos", "reference")),
        ("reference", ("reference", "flagos", "vendor")),
    ],
)
def test_default_orders(prefer, order):
    assert DEFAULT_ORDERS[prefer] == order
    assert SelectionPolicy(prefer=prefer).order_for("anything") == (order, False)


def test_per_op_order_gets_the_default_order_as_implicit_tail():
    p = SelectionPolicy(prefer="vendor", per_op_order={"relu": "reference|vendor:acme"})
    assert p.order_for("relu") == (("reference", "vendor:acme", "vendor", "flagos"), False)
    assert p.order_for("gelu") == (DEFAULT_ORDERS["vendor"], False)


def test_only_marker_makes_the_per_op_order_exclusive():
    p = SelectionPolicy(per_op_order={"relu": "vendor:acme|reference|only"})
    assert p.order_for("relu") == (("vendor:acme", "reference"), True)


def test_deny_beats_allow_and_allow_restricts():
    p = SelectionPolicy(allow_vendors={"acme", "evil"}, deny_vendors={"evil"})
    assert p.vendor_allowed("acme") is None
    assert "denied" in p.vendor_allowed("evil")
    assert "allow list" in p.vendor_allowed("other")
    assert SelectionPolicy().vendor_allowed("anyone") is None


# -- global policy -----------------------------------------------------------------------------
def test_global_policy_is_read_from_the_environment_once(monkeypatch):
    monkeypatch.setenv("TE_FL_PREFER", "reference")
    reset_global_policy()
    assert get_policy().prefer == "reference"
    monkeypatch.setenv("TE_FL_PREFER", "vendor")
    assert get_policy().prefer == "reference"  # read once ...
    reset_global_policy()
    assert get_policy().prefer == "vendor"  # ... until reset


def test_strict_is_read_with_everything_else_not_live(monkeypatch):
    assert get_policy().strict is False
    monkeypatch.setenv("TE_FL_STRICT", "1")
    assert get_policy().strict is False
    reset_global_policy()
    assert get_policy().strict is True


def test_set_global_policy_returns_the_previous_one_and_checks_its_type():
    first = get_policy()
    new = SelectionPolicy(prefer="vendor")
    assert set_global_policy(new) is first
    assert get_policy() is new
    with pytest.raises(TypeError, match="expected a SelectionPolicy, got dict"):
        set_global_policy({"prefer": "vendor"})


# -- scoped overrides --------------------------------------------------------------------------
def test_scoped_overrides_nest_and_restore():
    outer = get_policy()
    with with_preference("reference"):
        assert get_policy().prefer == "reference"
        with with_strict_mode():
            assert get_policy().prefer == "reference" and get_policy().strict
            with with_strict_mode(strict=False):
                assert not get_policy().strict
            assert get_policy().strict
        assert not get_policy().strict
    assert get_policy() is outer


def test_policy_context_yields_and_installs_the_policy():
    p = SelectionPolicy(prefer="vendor", strict=True)
    with policy_context(p) as active:
        assert active is p and get_policy() is p
    assert get_policy() is not p


def test_allowed_vendors_replace_and_denied_vendors_add():
    with with_allowed_vendors("ACME", "Other"):
        assert get_policy().allow_vendors == frozenset({"acme", "other"})
        with with_allowed_vendors("acme"):
            assert get_policy().allow_vendors == frozenset({"acme"})
    with with_denied_vendors("A"):
        with with_denied_vendors("B"):
            assert get_policy().deny_vendors == frozenset({"a", "b"})
        assert get_policy().deny_vendors == frozenset({"a"})


def test_bad_scoped_preference_raises_before_entering():
    with pytest.raises(ValueError, match="'cuda'"):
        with with_preference("cuda"):
            pass
    assert get_policy().prefer == "flagos"


def test_override_is_restored_after_an_exception():
    with pytest.raises(KeyError):
        with with_preference("vendor"):
            raise KeyError("boom")
    assert get_policy().prefer == "flagos"


def test_scoped_policy_is_private_to_its_thread():
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with with_preference("reference"):
            inside.set()
            release.wait(10)
            seen["worker"] = get_policy().prefer

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside.wait(10)
    seen["main"] = get_policy().prefer  # while the worker's override is active
    release.set()
    thread.join(10)
    assert seen == {"main": "flagos", "worker": "reference"}


def test_scoped_policy_is_private_to_its_asyncio_task():
    async def task(prefer, gate):
        with with_preference(prefer):
            await gate.wait()  # both tasks are inside their block at the same time
            return get_policy().prefer

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(task(p, gate)) for p in ("vendor", "reference")]
        await asyncio.sleep(0)
        gate.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == ["vendor", "reference"]
    assert get_policy().prefer == "flagos"


def test_many_threads_read_and_override_concurrently():
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        prefer = ("flagos", "vendor", "reference")[i % 3]
        try:
            barrier.wait(10)
            for _ in range(200):
                with with_preference(prefer), with_denied_vendors(f"v{i}"):
                    p = get_policy()
                    assert p.prefer == prefer and p.deny_vendors == {f"v{i}"}
                assert get_policy().prefer == "flagos"
        except Exception as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []


def test_a_measured_order_puts_its_tokens_first_under_the_default_preference():
    measured = {"fused_attn_fwd": ("vendor",)}
    default = SelectionPolicy()
    assert default.order_for("fused_attn_fwd", measured) == (("vendor", "flagos", "reference"), False)
    assert default.order_for("gemm", measured) == (("flagos", "vendor", "reference"), False)
    assert default.order_for("fused_attn_fwd") == (("flagos", "vendor", "reference"), False)  # none declared
    # a user per-op entry or another preference replaces it
    assert SelectionPolicy(per_op_order={"fused_attn_fwd": "flagos"}).order_for("fused_attn_fwd", measured)[0][0] == "flagos"
    assert SelectionPolicy(prefer="reference").order_for("fused_attn_fwd", measured)[0][0] == "reference"
    assert SelectionPolicy(prefer="vendor").order_for("fused_attn_fwd", {"fused_attn_fwd": ("reference",)})[0][0] == "vendor"


def test_the_cuda_backend_declares_its_measured_orders():
    """The measurements (cuDNN attention ahead of the flagos kernel; PyTorch's GELU / SiLU as fast, and cheaper on the
    host) are the vendor backend's data."""
    from transformer_engine.plugin.backends.vendor import cuda

    orders = check_measured_per_op(cuda.TE_FL_MEASURED_PER_OP)
    assert orders == {op: ("vendor",) for op in ("fused_attn_fwd", "fused_attn_bwd", "gelu", "dgelu", "silu", "dsilu")}


def test_measured_orders_are_checked():
    assert check_measured_per_op({"gemm": "Vendor:ACME|reference", "relu": ["flagos"]}) == {
        "gemm": ("vendor:acme", "reference"), "relu": ("flagos",)}
    with pytest.raises(TypeError):
        check_measured_per_op([("gemm", "vendor")])
    with pytest.raises(ValueError, match="may not end with 'only'"):
        check_measured_per_op({"gemm": "vendor|only"})
    with pytest.warns(PolicyConfigWarning), pytest.raises(ValueError, match="invalid per-op order"):
        check_measured_per_op({"gemm": "fastest"})
