"""The op catalog: every built-in declaration is complete; declare/get_spec/check_impl rules; no torch on import."""

import inspect
import keyword
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import transformer_engine.plugin.catalog as builtin_catalog
from transformer_engine.plugin.core import CatalogError, OpSpec, declare, get_spec, list_specs

REPO = Path(__file__).resolve().parents[3]


# -- the built-in declarations -----------------------------------------------------------------
def test_catalog_is_not_empty_and_sorted_without_duplicates():
    names = [spec.name for spec in list_specs()]
    assert len(names) >= 50
    assert names == sorted(set(names))


@pytest.mark.parametrize("spec", list_specs(), ids=lambda s: s.name)
def test_every_op_has_math_a_key_param_and_a_plain_signature(spec):
    assert spec.name.isidentifier() and not keyword.iskeyword(spec.name)
    assert spec.doc.strip(), f"op {spec.name} has no docstring"
    assert "=" in spec.doc, f"op {spec.name}'s docstring states no formula"
    params = spec.signature.parameters
    assert spec.key_param in params
    assert params[spec.key_param].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert params[spec.key_param].default is inspect.Parameter.empty, "the key argument must be required"
    assert list(params)[spec.key_index] == spec.key_param
    assert get_spec(spec.name) is spec


def test_every_op_is_declared_in_exactly_one_family_module():
    family_of = {}
    for family in builtin_catalog.__all__:
        for value in vars(getattr(builtin_catalog, family)).values():
            if isinstance(value, OpSpec):
                assert value.name not in family_of, f"op {value.name} declared in {family_of[value.name]} and {family}"
                family_of[value.name] = family
    assert set(family_of) == {spec.name for spec in list_specs()}


def test_multi_tensor_updates_are_in_place_and_keyed_on_the_tensor_lists():
    for name in ("multi_tensor_adam", "multi_tensor_scale", "multi_tensor_sgd"):
        spec = get_spec(name)
        assert spec.inplace and spec.key_param == "tensor_lists"


# -- declare / get_spec / check_impl -----------------------------------------------------------
def test_declare_bare_and_with_options(restore_catalog):
    @declare
    def tefl_test_plain(x, y=1):
        """z = x + y."""

    @declare(key="y", inplace=True)
    def tefl_test_keyed(x, y):
        """y += x."""

    assert tefl_test_plain.name == "tefl_test_plain" and tefl_test_plain.key_param == "x" and not tefl_test_plain.inplace
    assert tefl_test_plain.doc == "z = x + y."
    assert tefl_test_keyed.key_param == "y" and tefl_test_keyed.key_index == 1 and tefl_test_keyed.inplace
    assert get_spec("tefl_test_keyed") is tefl_test_keyed


def test_redeclaring_the_same_signature_is_a_no_op_and_another_raises(restore_catalog):
    def tefl_test_op(x, eps=1e-5):
        """y = x + eps."""

    first = declare(tefl_test_op)
    assert declare(tefl_test_op) is first

    def tefl_test_op(x, eps=1e-6):  # noqa: F811 - the conflicting redeclaration is the point
        """y = x + eps."""

    with pytest.raises(CatalogError, match="'tefl_test_op' is already declared with signature"):
        declare(tefl_test_op)

    def tefl_test_op(x, eps=1e-5):  # noqa: F811
        """y = x + eps."""

    with pytest.raises(CatalogError, match="already declared"):
        declare(inplace=True)(tefl_test_op)


def test_declare_rejects_stubs_without_parameters_or_with_a_bad_key(restore_catalog):
    def tefl_test_empty():
        """Nothing."""

    with pytest.raises(CatalogError, match="declares no parameters"):
        declare(tefl_test_empty)

    def tefl_test_badkey(x):
        """y = x."""

    with pytest.raises(CatalogError, match="key parameter 'w' is not a parameter"):
        declare(key="w")(tefl_test_badkey)


def test_get_spec_unknown_name_suggests_close_ones():
    with pytest.raises(KeyError, match="unknown op 'layernorm_fw'; did you mean layernorm_fwd"):
        get_spec("layernorm_fw")
    with pytest.raises(KeyError, match=r"^\"unknown op 'zzz_qqq'\"$"):
        get_spec("zzz_qqq")


def test_check_impl_accepts_equal_and_rejects_different_signatures():
    spec = get_spec("dgelu")

    def dgelu(dy, x):
        return dy

    spec.check_impl(dgelu, "reference.torch")
    spec.check_impl(lambda dy, x: dy, "reference.torch")

    def swapped(x, dy):
        return dy

    with pytest.raises(CatalogError,
                       match=r"reference.torch: the impl of op 'dgelu' has signature \(x, dy\), but the catalog declares dgelu\(dy, x\)"):
        spec.check_impl(swapped, "reference.torch")


def test_check_impl_on_a_callable_without_signature():
    with pytest.raises(CatalogError, match="cannot read the signature of the impl of 'gelu'"):
        get_spec("gelu").check_impl(iter, "vendor.x")


# -- import hygiene ----------------------------------------------------------------------------
def test_importing_the_package_and_the_plugin_layer_imports_no_framework():
    code = textwrap.dedent(
        """
        import sys
        import transformer_engine
        import transformer_engine.plugin as plugin
        from transformer_engine.plugin import ops
        from transformer_engine.plugin.core import list_specs
        assert len(list_specs()) > 0 and callable(ops.gemm)
        heavy = sorted(m for m in ("torch", "triton", "jax", "numpy") if m in sys.modules)
        backends = sorted(m for m in sys.modules if m.startswith("transformer_engine.plugin.backends."))
        print(heavy, backends)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] []"
