"""graph.save_fp8_tensors / restore_fp8_tensors / set_capture_start / set_capture_end / is_graph_capturing: the
helpers Megatron-Core's own CUDA-graph capture of TE modules imports."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.graph import (
    is_graph_capturing, make_graphed_callables, restore_fp8_tensors, save_fp8_tensors, set_capture_end, set_capture_start,
)


def _state(layer):
    return [t.clone() for m in layer.modules() if hasattr(m, "fp8_meta")
            for s in (m.fp8_meta["scaling_fwd"], m.fp8_meta["scaling_bwd"]) if s is not None
            for t in (s.amax_history, s.scale, s.scale_inv)]


def test_warm_up_steps_leave_the_delayed_scaling_state_as_saved():
    torch.manual_seed(0)
    layer = te.TransformerLayer(64, 128, 4)
    recipe = DelayedScaling(amax_history_len=4)
    saved = save_fp8_tensors([layer], recipe)
    assert len(saved) == len(list(layer.modules())) and sum(s is not None for s in saved) == 3  # qkv, proj, mlp
    before = _state(layer)
    assert all(s.amax_history.shape[0] == 4 for m in layer.modules() if getattr(m, "fp8_meta", None)
               for s in (m.fp8_meta["scaling_fwd"],) if s is not None)  # made with the recipe's history length
    for _ in range(2):  # warm-up steps update every state
        with te.autocast(recipe=recipe):
            layer(torch.randn(8, 2, 64)).sum().backward()
    assert not all(torch.equal(a, b) for a, b in zip(_state(layer), before))
    restore_fp8_tensors([layer], saved)
    assert all(torch.equal(a, b) for a, b in zip(_state(layer), before))


def test_other_recipes_save_nothing_and_mismatches_raise():
    layer = te.Linear(32, 32)
    assert save_fp8_tensors([layer], Float8CurrentScaling()) is None
    restore_fp8_tensors([layer], None)  # nothing to do
    saved = save_fp8_tensors([layer], DelayedScaling())
    with pytest.raises(RuntimeError, match="state of 1 submodules for 2"):
        restore_fp8_tensors([layer, te.Linear(32, 32)], saved)


def test_capture_flag():
    assert not is_graph_capturing()
    set_capture_start()
    try:
        assert is_graph_capturing()
    finally:
        set_capture_end()
    assert not is_graph_capturing()


@pytest.mark.gpu
def test_make_graphed_callables_marks_its_capture():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = te.Linear(32, 32, device="cuda")

        def forward(self, x):
            seen.append(is_graph_capturing())
            return self.linear(x)

    graphed = make_graphed_callables(Probe(), (torch.randn(16, 32, device="cuda", requires_grad=True),))
    assert seen and all(seen) and not is_graph_capturing()
    graphed(torch.randn(16, 32, device="cuda", requires_grad=True)).sum().backward()
