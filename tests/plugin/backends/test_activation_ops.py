"""The shared table of activation op functions: names, signatures, delegation, missing names."""


import pytest

from transformer_engine.plugin.backends import _activation_ops
from transformer_engine.plugin.backends._activation_ops import ACTIVATION_OP_NAMES, activation_ops, module_getattr
from transformer_engine.plugin.core.catalog import get_spec


def _table(calls):
    return activation_ops(lambda op, *a: calls.append(("fwd", op, a)) or "y",
                          lambda op, *a: calls.append(("bwd", op, a)) or "dx")


def test_every_op_has_the_catalog_signature_and_docstring():
    table = _table([])
    assert sorted(table) == sorted(ACTIVATION_OP_NAMES) and len(table) == 24
    for name, fn in table.items():
        get_spec(name).check_impl(fn, "activation_ops")  # names, kinds and defaults, as registration checks them
        assert fn.__name__ == name and fn.__doc__ == get_spec(name).doc


def test_ops_delegate_to_the_launchers_with_their_forward_name(monkeypatch):
    calls = []
    monkeypatch.setattr(_activation_ops, "check_clamp", lambda limit, alpha: calls.append(("check", limit, alpha)))
    table = _table(calls)
    assert table["geglu"]("x") == "y" and table["dgeglu"]("dy", "x") == "dx"
    assert table["clamped_dswiglu"]("dy", "x", 5.0, 1.5) == "dx"
    assert calls == [("fwd", "geglu", ("x",)), ("bwd", "geglu", ("dy", "x")),
                     ("check", 5.0, 1.5), ("bwd", "clamped_swiglu", ("dy", "x", 5.0, 1.5))]


def test_module_getattr_serves_the_table_and_names_missing_attributes():
    getattr_fn = module_getattr({"gelu": len}, "pkg.activation")
    assert getattr_fn("gelu") is len
    with pytest.raises(AttributeError, match="'pkg.activation' has no attribute 'nope'"):
        getattr_fn("nope")
