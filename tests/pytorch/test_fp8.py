"""The deprecated ``transformer_engine.pytorch.fp8`` shim: warns on import, keeps the names clients use."""

import importlib
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import transformer_engine.pytorch.fp8 as fp8


def test_import_warns():
    with pytest.warns(DeprecationWarning, match="transformer_engine.pytorch.fp8 is deprecated"):
        importlib.reload(fp8)


def test_legacy_names():
    ok, reason = fp8.check_mxfp8_support()
    assert ok is True and "emulated" in reason
    assert isinstance(fp8.check_fp8_support()[0], bool)
    assert not fp8.FP8GlobalStateManager.is_fp8_enabled()
    assert callable(fp8.fp8_autocast) and callable(fp8.fp8_model_init)
    assert fp8.get_default_fp8_recipe() == fp8.DelayedScaling()
