"""transformer_engine.common.recipe: TE's fields, defaults, validation, predicates; no torch import."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)

ALL_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def test_import_does_not_import_torch():
    code = "import sys, transformer_engine.common.recipe as r; r.DelayedScaling(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize(
    "fmt, fwd, bwd",
    [(Format.E4M3, 448, 448), (Format.E5M2, 57344, 57344), (Format.HYBRID, 448, 57344), (Format.E2M1, 6, 6)],
)
def test_format_max_values(fmt, fwd, bwd):
    assert (fmt.value.max_fwd, fmt.value.max_bwd) == (fwd, bwd)


def test_delayed_scaling_defaults():
    r = DelayedScaling()
    expected = dict(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                    scaling_factor_compute_algo=None, reduce_amax=True, fp8_dpa=False, fp8_mha=False, backward_override=None)
    assert {k: getattr(r, k) for k in expected} == expected
    assert [f.name for f in dataclasses.fields(r)] == list(expected)


def test_current_scaling_defaults():
    r = Float8CurrentScaling()
    assert r.fp8_format == Format.HYBRID and r.use_power_2_scales is False
    assert r.fp8_gemm_fprop == MMParams(use_split_accumulator=False) and r.fp8_gemm_dgrad == MMParams(use_split_accumulator=True) \
        and r.fp8_gemm_wgrad == MMParams(use_split_accumulator=True)
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=False, amax_epsilon=0.0)
    assert "fp8_quant_fwd_inp" not in [f.name for f in dataclasses.fields(r)]


def test_block_recipes_defaults():
    assert MXFP8BlockScaling().fp8_format == Format.E4M3
    b = Float8BlockScaling()
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert b.fp8_quant_fwd_weight.power_2_scale is True  # pow-2 scales unless use_f32_scales
    n = NVFP4BlockScaling()
    assert n.fp4_format == Format.E2M1 and n.fp8_format == Format.E4M3
    assert n.fp4_quant_fwd_inp.random_hadamard_transform and n.fp4_quant_fwd_weight.fp4_2d_quantization
    assert n.fp4_quant_bwd_grad.stochastic_rounding


def test_env_driven_defaults(monkeypatch):
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")
    monkeypatch.setenv("NVTE_NVFP4_DISABLE_RHT", "1")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert Float8CurrentScaling().use_power_2_scales is True
    assert NVFP4BlockScaling().disable_rht is True
    assert Float8CurrentScaling().backward_override == "dequantized"
    with pytest.raises(ValueError, match="backward_override"):
        DelayedScaling()


@pytest.mark.parametrize("cls", ALL_RECIPES[:4])
def test_pure_e5m2_rejected(cls):
    with pytest.raises(ValueError, match="Pure E5M2 training is not supported"):
        cls(fp8_format=Format.E5M2)


@pytest.mark.parametrize("field, value", [("interval", 2), ("override_linear_precision", (False, False, True))])
def test_removed_fields_say_removed(field, value):
    with pytest.raises(TypeError, match=f"{field}=.*removed"):
        DelayedScaling(**{field: value})


@pytest.mark.parametrize("field, value", [("interval", 1), ("override_linear_precision", (False, False, False)),
                                          ("override_linear_precision", [False, False, False])])
def test_removed_fields_accept_the_honoured_value(field, value):
    """Megatron-Core passes override_linear_precision=(False, False, not fp8_wgrad): all-FP8 is what runs."""
    assert DelayedScaling(amax_history_len=8, **{field: value}) == DelayedScaling(amax_history_len=8)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(margin=-1), ValueError, "margin must be >= 0"),
        (dict(margin=1.5), TypeError, "margin must be an int"),
        (dict(amax_history_len=0), ValueError, "amax_history_len"),
        (dict(amax_compute_algo="mean"), ValueError, "amax_compute_algo"),
        (dict(scaling_factor_compute_algo=3), TypeError, "scaling_factor_compute_algo"),
        (dict(fp8_format="HYBRID"), TypeError, "fp8_format"),
        (dict(reduce_amax=1), TypeError, "reduce_amax"),
    ],
)
def test_delayed_scaling_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DelayedScaling(**kwargs)


def test_other_validation():
    with pytest.raises(ValueError, match="both use 2-D"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="fp8_gemm_fprop"):
        Float8BlockScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=False))
    with pytest.raises(ValueError, match="nvfp4_4over6"):
        NVFP4BlockScaling(nvfp4_4over6="some")


def test_nvfp4_4over6_fast_math_env_is_not_silently_ignored(monkeypatch):
    monkeypatch.setenv("NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH", "1")
    with pytest.warns(UserWarning, match="FAST_MATH"):
        NVFP4BlockScaling(nvfp4_4over6="weights")
    with pytest.raises(TypeError, match="qfactory"):
        CustomRecipe()


def test_callable_algorithms_accepted():
    r = DelayedScaling(amax_compute_algo=lambda h: h.max(0).values, scaling_factor_compute_algo=lambda a, s, m, r: s)
    assert callable(r.amax_compute_algo)


def test_predicates():
    flags = {
        DelayedScaling: ("delayed", "float8_per_tensor_scaling"),
        Float8CurrentScaling: ("float8_current_scaling", "float8_per_tensor_scaling"),
        Float8BlockScaling: ("float8_block_scaling",),
        MXFP8BlockScaling: ("mxfp8",),
        NVFP4BlockScaling: ("nvfp4",),
    }
    names = ("delayed", "mxfp8", "nvfp4", "float8_current_scaling", "float8_per_tensor_scaling", "float8_block_scaling", "custom")
    for cls, true_ones in flags.items():
        r = cls()
        assert isinstance(r, Recipe)
        assert {n for n in names if getattr(r, n)()} == set(true_ones) == {n for n in names if getattr(cls, n)()}
    assert CustomRecipe(qfactory=lambda role: None).custom()


def test_frozen_equality_and_hash():
    a, b = DelayedScaling(margin=1), DelayedScaling(margin=1)
    assert a == b and hash(a) == hash(b) and a != DelayedScaling(margin=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.margin = 3
