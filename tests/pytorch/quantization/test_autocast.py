"""autocast / fp8_autocast: nesting, validation, emulation switch, calibration, recipe changes, FP8GlobalStateManager."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, availability, current_config


def test_nesting_restores_the_outer_setting():
    outer, inner = DelayedScaling(amax_history_len=2), Float8CurrentScaling()
    assert not current_config().enabled
    with te.autocast(recipe=outer):
        assert current_config().recipe == outer and FP8GlobalStateManager.is_fp8_enabled()
        with te.autocast(enabled=False, recipe=inner):
            assert not current_config().enabled and current_config().recipe == inner
            assert FP8GlobalStateManager.get_autocast_depth() == 2
        assert current_config().enabled and FP8GlobalStateManager.get_fp8_recipe() == outer
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_autocast_depth() == 0


def test_same_instance_cannot_be_entered_twice():
    ctx = te.autocast(recipe=DelayedScaling())
    with ctx:
        with pytest.raises(RuntimeError, match="already active"):
            ctx.__enter__()
    with ctx:  # re-usable once exited
        pass


def test_fp8_autocast_is_a_deprecated_alias():
    group = object()
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        ctx = te.fp8_autocast(enabled=True, calibrating=False, fp8_recipe=Float8CurrentScaling(), fp8_group=group)
    with ctx:
        config = current_config()
        assert config.recipe == Float8CurrentScaling() and config.amax_reduction_group is group


def test_default_recipe_on_cpu_is_delayed():
    with te.autocast():
        assert isinstance(current_config().recipe, DelayedScaling)


def test_nvfp4_options_the_modules_do_not_implement_raise():
    with pytest.raises(NotImplementedError, match="NVFP4BlockScaling\\(row_scaled_activation=True\\)"):
        with te.autocast(recipe=NVFP4BlockScaling(row_scaled_activation=True)):
            pass
    assert not current_config().enabled
    with te.autocast(recipe=NVFP4BlockScaling()):
        assert current_config().recipe.nvfp4()
    assert NVFP4BlockScaling().nvfp4_4over6_e4m3_use_256 == "all"  # NVIDIA TE's default; without 4over6 it means nothing
    with te.autocast(recipe=NVFP4BlockScaling(nvfp4_4over6_e4m3_use_256="none")):
        assert current_config().recipe.nvfp4()


def test_nvfp4_4over6_runs_and_refuses_the_rht_on_activations_as_te():
    """4over6 is implemented (tests/pytorch/quantization/test_nvfp4_4over6.py); TE refuses it on tensors that use the
    RHT, which the recipe's defaults apply to activations: "activations" / "all" need disable_rht=True."""
    for options in ({"nvfp4_4over6": "weights"}, {"nvfp4_4over6": "all", "disable_rht": True, "nvfp4_4over6_e4m3_use_256": "none"},
                    {"nvfp4_4over6": "activations", "disable_rht": True, "nvfp4_4over6_err_mode": "MSE"}):
        with te.autocast(recipe=NVFP4BlockScaling(**options)):
            assert current_config().recipe.nvfp4_4over6 == options["nvfp4_4over6"]
    for scope in ("activations", "all"):
        with pytest.raises(ValueError, match=f"nvfp4_4over6='{scope}', disable_rht=False.*does not support RHT"):
            with te.autocast(recipe=NVFP4BlockScaling(nvfp4_4over6=scope)):
                pass
        assert not current_config().enabled


def test_mxfp8_runs_emulated_on_every_device(monkeypatch):
    """MXFP8 needs no FP8 hardware of its own rule: emulated on a CPU and on GPUs without FP8 at all."""
    with te.autocast(recipe=MXFP8BlockScaling()):
        assert isinstance(current_config().recipe, MXFP8BlockScaling)
    monkeypatch.setattr(availability, "_cuda_capability", lambda: (8, 0))
    monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    with pytest.raises(RuntimeError, match="8.9 or higher"):
        with te.autocast(recipe=DelayedScaling()):
            pass
    with te.autocast(recipe=MXFP8BlockScaling()):
        assert isinstance(current_config().recipe, MXFP8BlockScaling)


def test_block_scaling_runs_where_supported_and_says_why_not(monkeypatch):
    with te.autocast(recipe=Float8BlockScaling()):
        assert isinstance(current_config().recipe, Float8BlockScaling)
    monkeypatch.setattr(availability, "_cuda_capability", lambda: (10, 0))
    monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    with pytest.raises(RuntimeError, match="compute capability 9.x .* sm_100"):
        with te.autocast(recipe=Float8BlockScaling()):
            pass
    assert not current_config().enabled


def test_block_scaling_rejects_e5m2_gradients_on_cuda(monkeypatch):
    monkeypatch.setattr(availability, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(availability, "_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    with pytest.raises(ValueError, match="E4M3 operands only"):
        with te.autocast(recipe=Float8BlockScaling(fp8_format=Format.HYBRID)):
            pass
    with te.autocast(recipe=Float8BlockScaling()):
        pass


def test_bad_recipe_and_backward_override(monkeypatch):
    with pytest.raises(TypeError, match="recipe must be"):
        with te.autocast(recipe="fp8"):
            pass
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    with pytest.raises(NotImplementedError, match="backward_override"):
        with te.autocast(recipe=Float8CurrentScaling()):
            pass


@pytest.mark.parametrize("recipe, match", [
    (DelayedScaling(fp8_mha=True), "fp8_mha=True"),
    (DelayedScaling(fp8_dpa=True, fp8_mha=True), "fp8_mha=True"),
    (Float8CurrentScaling(fp8_dpa=True), "implemented for DelayedScaling only"),
])
def test_unimplemented_fp8_attention_is_refused_not_ignored(recipe, match):
    """FP8 across the attention's boundaries (fp8_mha), and FP8 attention under recipes other than DelayedScaling, fail at
    the autocast, before any module runs; DelayedScaling(fp8_dpa=True) enters (tests/pytorch/attention/test_fp8_attention.py)."""
    with pytest.raises(NotImplementedError, match=match):
        with te.autocast(recipe=recipe):
            pass
    with te.autocast(recipe=DelayedScaling(fp8_dpa=True)):
        pass


def _pretend_gpu(monkeypatch, capability):
    monkeypatch.setattr(availability, "_cuda_capability", lambda: capability)


def test_gpu_without_fp8_needs_explicit_emulation(monkeypatch):
    _pretend_gpu(monkeypatch, (8, 6))
    monkeypatch.delenv(availability.FP8_EMULATION_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"8\.9 or higher.*TE_FL_FP8_EMULATION=1"):
        with te.autocast(recipe=DelayedScaling()):
            pass
    with te.autocast(enabled=False):  # high precision is always fine
        pass
    monkeypatch.setenv(availability.FP8_EMULATION_ENV, "1")
    with te.autocast(recipe=DelayedScaling()):
        assert current_config().enabled
    _pretend_gpu(monkeypatch, (9, 0))
    monkeypatch.delenv(availability.FP8_EMULATION_ENV)
    with te.autocast(recipe=DelayedScaling()):
        pass


def test_calibration_computes_in_high_precision_and_records_amax():
    layer = te.Linear(16, 16)
    x = torch.randn(8, 16)
    reference = layer(x)
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling(amax_history_len=4)):
        out = layer(x)
    assert torch.equal(out, reference)
    state = layer.fp8_meta["scaling_fwd"]
    assert state.amax_history[0, 0] == x.abs().max() and state.amax_history[0, 1] == layer.weight.abs().max()
    assert torch.all(state.scale == 1.0)  # not enabled: no update at exit


def test_recipe_type_change_warns_and_rebuilds():
    layer = te.Linear(16, 16)
    x = torch.randn(8, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        layer(x)
    with pytest.warns(UserWarning, match="Recipe type changed from DelayedScaling to Float8CurrentScaling"):
        with te.autocast(recipe=Float8CurrentScaling()):
            layer(x)
    assert not layer.fp8_meta["scaling_fwd"].has_amax_history


def test_history_length_change_resizes_in_place():
    layer = te.Linear(16, 16)
    x = torch.randn(8, 16)
    for _ in range(3):
        with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
            layer(x)
    before = layer.fp8_meta["scaling_fwd"].amax_history.clone()
    with pytest.warns(UserWarning, match="Quantizer is being updated, this may affect model behavior"):
        with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
            layer(x * 0)  # amax 0: idle slots, so the resized history is kept as is
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, before[:2])


def test_global_state_manager_queries():
    assert FP8GlobalStateManager.is_fp8_available() == availability.check_fp8_support()
    assert FP8GlobalStateManager.is_mxfp8_available() == availability.check_mxfp8_support()
    assert FP8GlobalStateManager.is_mxfp8_available()[0] is True
    assert FP8GlobalStateManager.fp8_graph_capturing() is False
    with te.autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        assert FP8GlobalStateManager.is_fp8_calibration() and not FP8GlobalStateManager.is_fp8_enabled()


def test_global_state_manager_meta_key_and_reset():
    assert FP8GlobalStateManager.get_meta_tensor_key(forward=True) == "scaling_fwd"
    assert FP8GlobalStateManager.get_meta_tensor_key(forward=False) == "scaling_bwd"
    layer = te.Linear(16, 16)
    context = te.autocast(recipe=DelayedScaling(amax_history_len=2))
    context.__enter__()  # left open, as a test that failed inside an autocast leaves it
    layer(torch.randn(8, 16))
    assert FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_autocast_depth() == 1
    FP8GlobalStateManager.reset()
    assert not FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_autocast_depth() == 0
    history = layer.fp8_meta["scaling_fwd"].amax_history.clone()
    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)  # the dropped update does not run
    assert torch.equal(layer.fp8_meta["scaling_fwd"].amax_history, history)


def test_isolated_stack_runs_an_inner_autocast_as_the_outermost():
    """Inside isolated_stack (CUDA-graph capture) an autocast's updates run at its own exit and backward,
    the callback sees each state before its update, and the caller's stack comes back unchanged."""
    from transformer_engine.pytorch.quantization.autocast import isolated_stack

    recipe = DelayedScaling(amax_history_len=4)
    layer = te.Linear(16, 16)
    seen = []
    with te.autocast(enabled=False):  # the caller's own autocast, still open during the capture
        with isolated_stack(lambda state: seen.append(float(state.amax_history.abs().sum()))):
            assert FP8GlobalStateManager.get_autocast_depth() == 0
            with te.autocast(recipe=recipe):
                y = layer(torch.randn(8, 16))
            fwd = layer.fp8_meta["scaling_fwd"]
            assert float(fwd.amax_history[0].abs().sum()) == 0.0 and float(fwd.amax_history[-1].abs().sum()) > 0  # rolled
            y.sum().backward()
            bwd = layer.fp8_meta["scaling_bwd"]
            assert float(bwd.amax_history[-1].abs().sum()) > 0  # the backward update ran at the end of backward
        assert seen == [0.0, 0.0]  # forward and backward states, seen before any update
        assert FP8GlobalStateManager.get_autocast_depth() == 1 and not current_config().enabled


def test_autocast_state_is_one_per_process_and_backward_runs_on_another_thread():
    """What the module docstring decides: another thread sees the active autocast (NVIDIA TE's global state), and a
    backward run on another thread, outside any autocast, still updates the gradients' delayed-scaling state."""
    import threading

    seen = []
    layer = te.Linear(16, 16)
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        worker = threading.Thread(target=lambda: seen.append(FP8GlobalStateManager.is_fp8_enabled()))
        worker.start()
        worker.join()
        y = layer(torch.randn(16, 16))
    assert seen == [True]
    worker = threading.Thread(target=lambda: y.sum().backward())
    worker.start()
    worker.join()
    assert layer.fp8_meta["scaling_bwd"].scale[0] != 1  # updated from the backward's amaxes (dy = 1)
