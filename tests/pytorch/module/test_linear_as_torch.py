"""te.Linear in high precision runs as torch.nn.functional.linear (PyTorch's autograd, no LinearFunction), and
te.LayerNormLinear as its norm's autograd node then that linear, exactly when the policy's first choice for ``gemm``
declares itself PyTorch's own matmul (``OpImpl.aten_dtypes``), and only where nothing needs the Function (FP8,
calibration, tensor parallelism, main_grad, delayed wgrads). Likewise a high-precision GELU / SiLU (``te.ops`` and
te.LayerNormMLP's) runs as ``F.gelu`` / ``F.silu`` when the first choices for the activation and its derivative declare
themselves those operators (vendor.cuda's, registered here on the CPU), else as ActivationFunction."""

import pytest
import torch

import transformer_engine.pytorch as te
from tests.pytorch.references import forward_backward
from tests.utils import autograd_node_names, dtype_tols, randn
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.plugin import BackendImplKind, Capabilities, OpImpl, get_default_manager, runs_as_aten
from transformer_engine.plugin.backends._registration import impls_from_modules
from transformer_engine.plugin.backends.reference import gemm as reference_gemm
from transformer_engine.plugin.backends.vendor.cuda import activation as vendor_activation

ATEN_ID = "vendor.test_aten"
FLOATS = ("float32", "bfloat16", "float16")


@pytest.fixture
def aten_gemm():
    """A CPU ``gemm`` ahead of the reference backend that declares itself PyTorch's matmul in high precision (its body is
    the reference GEMM: what the Function path would run)."""
    registry = get_default_manager().registry
    get_default_manager().ensure_initialized()
    impl = OpImpl("gemm", ATEN_ID, BackendImplKind.VENDOR, reference_gemm.gemm, vendor="test_aten",
                  capabilities=Capabilities(device_types=frozenset({"cpu"})), aten_dtypes=frozenset(FLOATS))
    registry.register(impl)
    yield impl
    registry.unregister("gemm", ATEN_ID)


@pytest.fixture
def aten_activations():
    """vendor.cuda's activations (PyTorch's own operators, which run on any device) registered for the CPU, where the
    default order puts them ahead of the reference backend."""
    manager = get_default_manager()
    manager.ensure_initialized()
    impls = impls_from_modules([vendor_activation], ATEN_ID, BackendImplKind.VENDOR, Capabilities(device_types=frozenset({"cpu"})),
                               vendor="test_aten")
    manager.registry.register_many(impls)
    yield impls
    for impl in impls:
        manager.registry.unregister(impl.op_name, ATEN_ID)


def _runs_function(y: torch.Tensor) -> bool:
    return bool({"LinearFunctionBackward", "LayerNormLinearFunctionBackward", "LayerNormMLPFunctionBackward"} & autograd_node_names(y))


def test_runs_as_aten_reads_the_first_choice(aten_gemm):
    cpu = torch.device("cpu")
    assert runs_as_aten("gemm", cpu, torch.bfloat16) and runs_as_aten("gemm", cpu, torch.float32)
    assert not runs_as_aten("gemm", cpu, torch.float8_e4m3fn)  # not declared for FP8 operands
    get_default_manager().registry.unregister("gemm", ATEN_ID)
    assert not runs_as_aten("gemm", cpu, torch.bfloat16)  # the reference backend declares nothing
    get_default_manager().registry.register(aten_gemm)


def test_reference_backend_keeps_the_function():
    layer = te.Linear(16, 8, params_dtype=torch.bfloat16)
    assert _runs_function(layer(randn(4, 16, dtype=torch.bfloat16).requires_grad_()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 16), (2, 3, 16), (2, 1, 3, 16)])
@pytest.mark.parametrize("bias, return_bias", [(True, False), (False, False), (True, True)])
def test_torch_linear_equals_the_function(aten_gemm, dtype, shape, bias, return_bias):
    layer = te.Linear(16, 8, bias=bias, return_bias=return_bias, params_dtype=dtype)
    x, dy = randn(*shape, dtype=dtype), randn(*shape[:-1], 8, dtype=dtype)
    y = layer(x.requires_grad_())
    out = y[0] if return_bias else y
    assert not _runs_function(out) and out.shape == (*shape[:-1], 8) and out.dtype == dtype
    if return_bias:
        assert torch.equal(y[1], layer.bias)
    layer.zero_grad(set_to_none=True)
    got = forward_backward(layer, x.detach(), dy)
    registry = get_default_manager().registry
    registry.unregister("gemm", ATEN_ID)  # the same module through LinearFunction and the reference GEMM
    layer.zero_grad(set_to_none=True)
    want = forward_backward(layer, x.detach(), dy)
    registry.register(aten_gemm)
    tols = dtype_tols(dtype)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, **tols)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **tols)


def _same_as_the_function(layer, aten_gemm, x: torch.Tensor, dy: torch.Tensor, dln) -> None:
    """``layer`` (a norm module with GEMMs, bf16) on PyTorch's linears, then on its Function (the aten-declared gemm
    unregistered): the same outputs and gradients, ln_out's included when the loss uses it (``dln`` not None)."""

    def step():
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        outs = layer(xi)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = (outs[0].float() * dy.float()).sum() + ((outs[-1].float() * dln.float()).sum() if dln is not None else 0)
        loss.backward()
        return [o.detach() for o in outs] + [xi.grad] + [p.grad for p in layer.parameters()], outs[0]

    got, out = step()
    assert not _runs_function(out)
    registry = get_default_manager().registry
    registry.unregister("gemm", ATEN_ID)
    want, out = step()
    registry.register(aten_gemm)
    assert _runs_function(out)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **dtype_tols(x.dtype))


@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", False), ("RMSNorm", False), ("LayerNorm", True)])
@pytest.mark.parametrize("return_layernorm_output, return_bias", [(False, False), (True, False), (True, True)])
def test_layernorm_linear_as_norm_then_torch_linear(aten_gemm, normalization, zero_centered, return_layernorm_output,
                                                   return_bias):
    """Norm node + PyTorch's linear against LayerNormLinearFunction: the same outputs and gradients, ln_out too (its
    gradient, when the caller uses it, joins the GEMM's as in the Function)."""
    dtype = torch.bfloat16
    layer = te.LayerNormLinear(16, 8, normalization=normalization, zero_centered_gamma=zero_centered, return_bias=return_bias,
                               return_layernorm_output=return_layernorm_output, params_dtype=dtype)
    with torch.no_grad():
        layer.layer_norm_weight.add_(randn(16, dtype=dtype, scale=0.1))
    _same_as_the_function(layer, aten_gemm, x=randn(2, 3, 16, dtype=dtype), dy=randn(2, 3, 8, dtype=dtype),
                          dln=randn(2, 3, 16, dtype=dtype) if return_layernorm_output else None)


@pytest.mark.parametrize("activation, normalization", [("gelu", "LayerNorm"), ("swiglu", "RMSNorm"), ("relu", "LayerNorm")])
@pytest.mark.parametrize("return_layernorm_output, return_bias", [(False, False), (True, True)])
def test_layernorm_mlp_as_nodes_and_torch_linears(aten_gemm, activation, normalization, return_layernorm_output, return_bias):
    """Norm node, PyTorch's linear, activation node, PyTorch's linear against LayerNormMLPFunction: the same outputs
    and gradients; checkpoint=True (recompute in backward) keeps the Function."""
    dtype = torch.bfloat16
    layer = te.LayerNormMLP(16, 24, activation=activation, normalization=normalization, return_bias=return_bias,
                            return_layernorm_output=return_layernorm_output, params_dtype=dtype)
    x = randn(2, 3, 16, dtype=dtype)
    _same_as_the_function(layer, aten_gemm, x=x, dy=randn(2, 3, 16, dtype=dtype),
                          dln=randn(2, 3, 16, dtype=dtype) if return_layernorm_output else None)
    recomputed = te.LayerNormMLP(16, 24, activation=activation, checkpoint=True, params_dtype=dtype)
    assert _runs_function(recomputed(x.clone().requires_grad_()))


def test_torch_autocast_casts_as_the_function(aten_gemm):
    layer = te.Linear(16, 8, params_dtype=torch.float32)
    x = randn(4, 16, dtype=torch.float32).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert not _runs_function(y) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("case", ["fp8", "calibration", "main_grad", "delayed_wgrad"])
def test_what_needs_the_function_keeps_it(aten_gemm, case):
    kwargs = {"main_grad": dict(fuse_wgrad_accumulation=True), "delayed_wgrad": dict(delay_wgrad_compute=True)}.get(case, {})
    layer = te.Linear(16, 16, params_dtype=torch.bfloat16, **kwargs)
    if case == "main_grad":
        layer.weight.main_grad = torch.zeros(16, 16, dtype=torch.float32)
    x = randn(16, 16, dtype=torch.bfloat16).requires_grad_()
    with te.autocast(enabled=case == "fp8", calibrating=case == "calibration", recipe=DelayedScaling()):
        y = layer(x)
    assert _runs_function(y)
    y.sum().backward()
    if case == "main_grad":
        assert layer.weight.main_grad.abs().sum() > 0


@pytest.mark.parametrize("make", [lambda: te.Linear(16, 8, params_dtype=torch.float32),
                                  lambda: te.LayerNormLinear(16, 8, return_layernorm_output=True, params_dtype=torch.float32),
                                  lambda: te.LayerNormMLP(16, 24, activation="swiglu", params_dtype=torch.float32)],
                         ids=["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_torch_linear_traces_whole(aten_gemm, make):
    layer = make()
    x = randn(2, 3, 16, dtype=torch.float32)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    outputs = layer(x.requires_grad_())
    assert not _runs_function(outputs[0] if isinstance(outputs, tuple) else outputs)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    torch._dynamo.reset()


def _activation_step(op, x: torch.Tensor, dy: torch.Tensor):
    """(y, dx, names of y's autograd nodes) of one forward and backward."""
    xi = x.clone().requires_grad_()
    y = op(xi)
    y.backward(dy)
    return y.detach(), xi.grad, autograd_node_names(y)


@pytest.mark.parametrize("op, node", [(te.ops.GELU, "GeluBackward0"), (te.ops.SiLU, "SiluBackward0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_runs_as_torch_operator(aten_activations, op, node, dtype):
    """te.ops.GELU / SiLU as PyTorch's node, equal to ActivationFunction on the reference kernels; a float32 input under
    torch.autocast is cast first and its gradient comes back in float32 on both paths."""
    x, dy = randn(6, 16, dtype=dtype), randn(6, 16, dtype=dtype)
    y, dx, names = _activation_step(op(), x, dy)
    assert node in names and "ActivationFunctionBackward" not in names
    for impl in aten_activations:
        get_default_manager().registry.unregister(impl.op_name, ATEN_ID)
    want_y, want_dx, names = _activation_step(op(), x, dy)
    get_default_manager().registry.register_many(aten_activations)
    assert "ActivationFunctionBackward" in names
    torch.testing.assert_close(y, want_y, **dtype_tols(dtype))
    torch.testing.assert_close(dx, want_dx, **dtype_tols(dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, names = _activation_step(op(), x.float(), dy.to(torch.bfloat16))
    assert node in names and y.dtype == torch.bfloat16 and dx.dtype == torch.float32


@pytest.mark.parametrize("case", ["no_derivative", "cached_input", "gated", "no_operator"])
def test_activation_keeps_the_function(aten_activations, case):
    """The Function where the derivative is not PyTorch's (a plugin's dgelu ahead), where the node keeps x in FP8, and for
    activations without one PyTorch operator (gated, qgelu)."""
    op = {"cached_input": lambda: te.ops.GELU(cache_quantized_input=True), "gated": te.ops.SwiGLU, "no_operator": te.ops.QGELU}
    if case == "no_derivative":
        get_default_manager().registry.unregister("dgelu", ATEN_ID)
    try:
        x, dy = randn(6, 16, dtype=torch.float32), randn(6, 8 if case == "gated" else 16)
        _, _, names = _activation_step(op.get(case, te.ops.GELU)(), x, dy)
    finally:
        if case == "no_derivative":
            get_default_manager().registry.register(next(i for i in aten_activations if i.op_name == "dgelu"))
    assert "ActivationFunctionBackward" in names


def test_layernorm_mlp_activation_as_torch_operator(aten_gemm, aten_activations):
    """te.LayerNormMLP bf16 with GELU: norm node, linear, PyTorch's GELU, linear; the same results as its Function."""
    dtype = torch.bfloat16
    layer = te.LayerNormMLP(16, 24, activation="gelu", params_dtype=dtype)
    x = randn(2, 3, 16, dtype=dtype)
    assert "GeluBackward0" in autograd_node_names(layer(x.clone().requires_grad_()))
    _same_as_the_function(layer, aten_gemm, x=x, dy=randn(2, 3, 16, dtype=dtype), dln=None)


def test_torch_activation_traces_whole(aten_gemm, aten_activations):
    layer = te.LayerNormMLP(16, 24, activation="gelu", params_dtype=torch.float32)
    x = randn(2, 3, 16, dtype=torch.float32)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_policy_runs_high_precision_as_torch_linear(dtype):
    """vendor.cuda's GEMM is the default choice on CUDA: te.Linear in high precision is nn.Linear's math, bit for bit."""
    layer = te.Linear(256, 128, params_dtype=dtype, device="cuda")
    ref = torch.nn.Linear(256, 128, dtype=dtype, device="cuda")
    ref.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "_extra_state"})
    x, dy = randn(4, 32, 256, dtype=dtype, device="cuda"), randn(4, 32, 128, dtype=dtype, device="cuda")
    assert not _runs_function(layer(x.requires_grad_()))
    got, want = forward_backward(layer, x.detach(), dy), forward_backward(ref, x.detach(), dy)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **dtype_tols(dtype))  # nn.Linear on 3-D input: matmul, not addmm
    with te.autocast(recipe=DelayedScaling()):
        assert _runs_function(layer(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_policy_runs_layernorm_linear_as_norm_then_torch_linear():
    """Under the default CUDA policy, te.LayerNormLinear bf16 = te.LayerNorm then nn.Linear, bit for bit in forward."""
    dtype = torch.bfloat16
    layer = te.LayerNormLinear(256, 128, params_dtype=dtype, device="cuda")
    norm, lin = te.LayerNorm(256, params_dtype=dtype, device="cuda"), torch.nn.Linear(256, 128, dtype=dtype, device="cuda")
    with torch.no_grad():
        norm.weight.copy_(layer.layer_norm_weight), norm.bias.copy_(layer.layer_norm_bias)
        lin.weight.copy_(layer.weight), lin.bias.copy_(layer.bias)
    x = randn(4, 32, 256, dtype=dtype, device="cuda")
    y = layer(x.requires_grad_())
    assert not _runs_function(y)
    torch.testing.assert_close(y, lin(norm(x)), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_cuda_policy_runs_layernorm_mlp_as_nodes_and_torch_linears(activation):
    """Under the default CUDA policy te.LayerNormMLP bf16 takes the four-node path; it matches the Function's (here with
    checkpoint=True, which keeps the Function) in outputs and gradients."""
    dtype = torch.bfloat16
    layer = te.LayerNormMLP(256, 512, activation=activation, params_dtype=dtype, device="cuda")
    fused = te.LayerNormMLP(256, 512, activation=activation, checkpoint=True, params_dtype=dtype, device="cuda")
    fused.load_state_dict(layer.state_dict())
    x, dy = randn(4, 32, 256, dtype=dtype, device="cuda"), randn(4, 32, 256, dtype=dtype, device="cuda")
    names = autograd_node_names(layer(x.clone().requires_grad_()))
    assert not _runs_function(layer(x.clone().requires_grad_()))
    assert ("GeluBackward0" in names) == (activation == "gelu")  # vendor.cuda's GELU is PyTorch's: its node
    got, want = forward_backward(layer, x, dy), forward_backward(fused, x, dy)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, **dtype_tols(dtype))
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **dtype_tols(dtype))
