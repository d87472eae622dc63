"""Availability queries and the default recipe per compute capability."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from transformer_engine.pytorch.quantization import availability


def test_return_reason_forms():
    for fn in (te.is_fp8_available, te.is_mxfp8_available, te.is_fp8_block_scaling_available, te.is_nvfp4_available,
               te.is_bf16_available):
        flag = fn()
        both = fn(return_reason=True)
        assert isinstance(flag, bool) and isinstance(both, tuple) and both[0] == flag and isinstance(both[1], str)
    available, reason = te.is_mxfp8_available(return_reason=True)
    assert available is True and "emulated" in reason  # MXFP8 runs everywhere, emulated exactly (tests/pytorch/quantization/test_mxfp8.py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_answers():
    assert te.get_device_compute_capability() == (0, 0)
    assert te.is_fp8_available(return_reason=True)[0] and "emulated" in te.is_fp8_available(return_reason=True)[1]
    assert te.is_bf16_available()


@pytest.mark.parametrize(
    "capability, fp8, bf16, recipe",
    [
        ((7, 0), False, False, DelayedScaling),
        ((8, 0), False, True, DelayedScaling),
        ((9, 0), True, True, DelayedScaling),
        ((10, 0), True, True, MXFP8BlockScaling),
        ((12, 0), True, True, Float8CurrentScaling),
    ],
)
def test_rules_per_capability(monkeypatch, capability, fp8, bf16, recipe):
    monkeypatch.setattr(availability, "_cuda_capability", lambda: capability)
    monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    assert te.is_fp8_available() is fp8
    assert te.is_bf16_available() is bf16
    assert type(te.get_default_recipe()) is recipe
    mxfp8, reason = te.is_mxfp8_available(return_reason=True)
    assert mxfp8 is True and "emulated" in reason and f"sm_{capability[0]}{capability[1]}" in reason
    assert ("has MXFP8 tensor cores" in reason) is ((10, 0) <= capability < (12, 0))


def test_sm89_needs_cuda_12_1(monkeypatch):
    monkeypatch.setattr(availability, "_cuda_capability", lambda: (8, 9))
    monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    monkeypatch.setattr(availability, "_cuda_version", lambda: (12, 0))
    assert not te.is_fp8_available()
    monkeypatch.setattr(availability, "_cuda_version", lambda: (12, 4))
    assert te.is_fp8_available()


@pytest.mark.parametrize(
    "capability, cuda, emulate, available",
    [((9, 0), (12, 9), False, True), ((9, 0), (12, 8), False, False), ((10, 0), (13, 0), False, False),
     ((8, 9), (13, 0), False, False), ((10, 0), (13, 0), True, True)],
)
def test_block_scaling_rule(monkeypatch, capability, cuda, emulate, available):
    monkeypatch.setattr(availability, "_cuda_capability", lambda: capability)
    monkeypatch.setattr(availability, "_cuda_version", lambda: cuda)
    if emulate:
        monkeypatch.setenv(availability.FP8_EMULATION_ENV, "1")
    else:
        monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    ok, reason = te.is_fp8_block_scaling_available(return_reason=True)
    assert ok is available
    assert (reason == "") if (available and not emulate) else f"sm_{capability[0]}{capability[1]}" in reason


def test_emulation_switch_parsing(monkeypatch):
    monkeypatch.setenv(availability.FP8_EMULATION_ENV, "yes")
    assert availability.fp8_emulation_requested()
    monkeypatch.setenv(availability.FP8_EMULATION_ENV, "maybe")
    with pytest.warns(UserWarning, match="TE_FL_FP8_EMULATION"):
        assert not availability.fp8_emulation_requested()


@pytest.mark.parametrize("encoded,expected",
                         [(91000, (9, 10, 0)), (90100, (9, 1, 0)), (8902, (8, 9, 2)), (8600, (8, 6, 0)), (None, (0, 0, 0))])
def test_cudnn_version_decodes_both_encodings(monkeypatch, encoded, expected):
    """cuDNN 9 encodes major * 10000, cuDNN 8 major * 1000 (NVIDIA TE's get_cudnn_version reads the same)."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: encoded is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: encoded)
    assert te.get_cudnn_version() == expected
