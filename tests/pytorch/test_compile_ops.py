"""torch.compile and the op catalog: an op traces as tensor ops or as a custom op (``TE_FL_COMPILE_OPS``), and eager
use never imports Dynamo."""

import subprocess
import sys

import pytest
import torch


def test_eager_use_imports_no_dynamo():
    """Building a module and running a training step eagerly leaves torch._dynamo unimported (it costs over
    a second): the compile paths are set up without it."""
    code = ("import sys, torch, transformer_engine.pytorch as te; from transformer_engine.common.recipe import DelayedScaling\n"
            "m = te.LayerNormMLP(32, 64)\n"
            "with te.autocast(recipe=DelayedScaling()):\n    y = m(torch.randn(16, 32))\n"
            "y.sum().backward()\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _traced_cast(monkeypatch, mode):
    """(target names in the Dynamo graph, compiled results, eager results, the amax written) of one
    ``ops.cast_transpose`` under ``TE_FL_COMPILE_OPS=mode``."""
    from transformer_engine.plugin import ops

    monkeypatch.setenv("TE_FL_COMPILE_OPS", mode)
    torch._dynamo.reset()
    ops.prepare_for_compile()
    x, scale, amax = torch.randn(8, 32), torch.tensor(4.0), torch.zeros(())

    def cast(x):
        q, q_t, scale_inv, amax_out = ops.cast_transpose(x, scale, torch.float8_e4m3fn, amax)
        return q.float() * scale_inv, q_t, amax_out

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(cast, backend=backend, fullgraph=True)
    expected = cast(x)
    amax.zero_()
    actual = compiled(x)
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    return targets, actual, expected, amax == x.abs().max()


@pytest.mark.parametrize("mode", ["traced", "custom_op"])
def test_catalog_ops_trace_as_tensor_ops_or_custom_ops(monkeypatch, mode):
    """By default an op traces as the tensor ops of its compiled form (here the reference backend's, which
    Inductor compiles); under TE_FL_COMPILE_OPS=custom_op as torch.ops.te_fl.<name>, whose fake
    implementation gives the shapes and dtypes of the real one. Both compute what eager does."""
    targets, actual, expected, amax_written = _traced_cast(monkeypatch, mode)
    custom_ops = {t for t in targets if t.startswith("te_fl.")}
    assert custom_ops == ({"te_fl.cast_transpose.default"} if mode == "custom_op" else set())
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a.float(), e.float(), rtol=0, atol=0)
    assert amax_written


def test_unknown_compile_ops_mode_is_named(monkeypatch):
    with pytest.raises(Exception, match="TE_FL_COMPILE_OPS='inline': use 'traced'"):
        _traced_cast(monkeypatch, "inline")
