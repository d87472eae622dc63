"""The tutorial example: the plain PyTorch layer and its three TE rewrites agree (shared parameters, no dropout)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from tests.utils import dtype_tols

_PATH = pathlib.Path(__file__).resolve().parents[3] / "examples" / "pytorch" / "transformer_layer_tutorial.py"
HP_TOLS = dict(rtol=1e-5, atol=5e-5)


@pytest.fixture(scope="module")
def tutorial():
    spec = importlib.util.spec_from_file_location("transformer_layer_tutorial", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_close(result, want, **tols):
    out, dx, grads = result
    torch.testing.assert_close(out, want[0], **tols)
    torch.testing.assert_close(dx, want[1], **tols)
    assert grads.keys() == want[2].keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want[2][name], **tols, msg=name)


def test_all_steps_agree(tutorial):
    layers = tutorial.make_layers(hidden_size=32, ffn_hidden_size=64, num_heads=4)
    results = tutorial.compare(layers, torch.randn(8, 2, 32))
    for name in ("basic_te", "fused_te", "te_layer"):
        _assert_close(results[name], results["basic"], **HP_TOLS)


def test_fp8_steps_agree_with_each_other(tutorial):
    layers = tutorial.make_layers(hidden_size=32, ffn_hidden_size=64, num_heads=4)
    results = tutorial.compare(layers, torch.randn(8, 2, 32), fp8=True)
    torch.testing.assert_close(results["te_layer"][0], results["basic"][0], **dtype_tols(torch.float8_e4m3fn))
    for name in ("fused_te", "te_layer"):  # same FP8 casts of the same tensors: equal up to fp32 rounding
        _assert_close(results[name], results["basic_te"], rtol=1e-4, atol=1e-4)
