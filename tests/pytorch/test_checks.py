"""Constructor checks of the modules: sizes, epsilons, activation and normalization names, before any work."""

from __future__ import annotations

import re

import pytest
import torch

import transformer_engine.pytorch as te

SIZES = [
    ("Linear", lambda a, b: te.Linear(a, b), ("in_features", "out_features")),
    ("LayerNormLinear", lambda a, b: te.LayerNormLinear(a, b), ("in_features", "out_features")),
    ("LayerNormMLP", lambda a, b: te.LayerNormMLP(a, b), ("hidden_size", "ffn_hidden_size")),
    ("GroupedLinear", lambda a, b: te.GroupedLinear(2, a, b), ("in_features", "out_features")),
]


@pytest.mark.parametrize("owner, build, names", SIZES, ids=[s[0] for s in SIZES])
@pytest.mark.parametrize("bad", [0, -3])
def test_non_positive_sizes_name_the_argument(owner, build, names, bad):
    first, second = names
    with pytest.raises(ValueError, match=re.escape(f"{owner}: {first}={bad} must be a positive integer (>= 1)")):
        build(bad, 8)
    with pytest.raises(ValueError, match=re.escape(f"{owner}: {second}={bad} must be a positive integer (>= 1)")):
        build(8, bad)


@pytest.mark.parametrize("owner, build, names", SIZES, ids=[s[0] for s in SIZES])
def test_non_integer_sizes_are_type_errors(owner, build, names):
    with pytest.raises(TypeError, match=re.escape(f"{owner}: {names[0]}=8.0 must be a positive integer, got float")):
        build(8.0, 8)
    with pytest.raises(TypeError, match=re.escape(f"{owner}: {names[1]}=True must be a positive integer, got bool")):
        build(8, b=True)


def test_grouped_linear_needs_at_least_one_gemm():
    with pytest.raises(ValueError, match=re.escape("GroupedLinear: num_gemms=0 must be a positive integer (>= 1)")):
        te.GroupedLinear(0, 8, 8)


EPS = [
    ("LayerNormLinear", lambda eps: te.LayerNormLinear(8, 8, eps=eps)),
    ("LayerNormMLP", lambda eps: te.LayerNormMLP(8, 8, eps=eps)),
    ("LayerNorm", lambda eps: te.LayerNorm(8, eps=eps)),
    ("RMSNorm", lambda eps: te.RMSNorm(8, eps=eps)),
]


@pytest.mark.parametrize("owner, build", EPS, ids=[e[0] for e in EPS])
@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf")])
def test_eps_must_be_finite_and_not_negative(owner, build, eps):
    message = f"{owner}: eps={eps!r} must be a finite number >= 0 (it is added to the variance under the square root)"
    with pytest.raises(ValueError, match=re.escape(message)):
        build(eps)


@pytest.mark.parametrize("owner, build", EPS, ids=[e[0] for e in EPS])
def test_zero_and_small_eps_are_accepted(owner, build):
    """NVIDIA TE accepts eps=0 too."""
    assert build(1e-12).eps == 1e-12 and build(0.0).eps == 0.0


@pytest.mark.parametrize("build", [lambda: te.LayerNormLinear(8, 8, normalization="layernorm"),
                                   lambda: te.LayerNormMLP(8, 8, normalization="rms")], ids=["LayerNormLinear", "LayerNormMLP"])
def test_unknown_normalization(build):
    with pytest.raises(ValueError, match=r"normalization='(layernorm|rms)' is not supported; use 'LayerNorm' or 'RMSNorm'"):
        build()


def test_unknown_activation():
    with pytest.raises(ValueError, match=re.escape("activation='gelu2' is not supported; choose one of [")):
        te.LayerNormMLP(8, 8, activation="gelu2")


@pytest.mark.parametrize("build", [
    lambda: te.Linear(0, 8), lambda: te.LayerNormLinear(8, 8, eps=-1.0), lambda: te.LayerNormMLP(8, 8, activation="nope"),
    lambda: te.LayerNormMLP(8, 8, normalization="nope"), lambda: te.GroupedLinear(2, 8, -1),
], ids=["Linear", "LayerNormLinear", "LayerNormMLP-act", "LayerNormMLP-norm", "GroupedLinear"])
def test_checks_run_before_any_parameter_is_allocated(build, monkeypatch):
    made = []
    original = torch.nn.Parameter.__new__
    monkeypatch.setattr(torch.nn.Parameter, "__new__", lambda cls, *a, **k: (made.append(1), original(cls, *a, **k))[1])
    with pytest.raises(ValueError):
        build()
    assert made == []
