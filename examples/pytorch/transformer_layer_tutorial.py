"""TE's quickstart, step by step: one GPT layer written four ways that share parameters and agree.

1. ``BasicTransformerLayer``: plain PyTorch (``nn.LayerNorm``, ``nn.Linear``, SDPA attention);
2. ``BasicTETransformerLayer``: the same with ``te.Linear`` and ``te.LayerNorm``;
3. ``FusedTETransformerLayer``: the norms fused into the GEMMs, ``te.LayerNormLinear`` + ``te.LayerNormMLP``;
4. ``te.TransformerLayer``: the whole layer in one module.

Each layer computes  h = x + proj(attn(qkv(LN1(x))));  out = h + fc2(gelu(fc1(LN2(h))))  with a causal
mask, tanh-GELU and the QKV features grouped per head ([q_h, k_h, v_h] for each head h, TE's
interleaved layout). Run ``python examples/pytorch/transformer_layer_tutorial.py`` to see that all four
give the same output and gradients, and then the TE layers under FP8 (``te.autocast``).
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling

__all__ = [
    "BasicTransformerLayer",
    "BasicTETransformerLayer",
    "FusedTETransformerLayer",
    "make_layers",
    "compare",
]


def causal_attention(qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d), causal) V from qkv [s, b, 3 * hidden] laid out [q_h, k_h, v_h] per head."""
    s, b, _ = qkv.shape
    q, k, v = qkv.view(s, b, num_heads, -1).chunk(3, dim=-1)  # each [s, b, heads, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class BasicMLP(torch.nn.Module):
    """fc2(gelu_tanh(fc1(x)))."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_size, ffn_hidden_size)
        self.linear2 = torch.nn.Linear(ffn_hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(x), approximate="tanh"))


class BasicTransformerLayer(torch.nn.Module):
    """Step 1: the GPT layer in plain PyTorch."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_heads: int, eps: float = 1e-5):
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.qkv_projection = torch.nn.Linear(hidden_size, 3 * hidden_size)
        self.projection = torch.nn.Linear(hidden_size, hidden_size)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = BasicMLP(hidden_size, ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.projection(causal_attention(self.qkv_projection(self.ln1(x)), self.num_heads))
        return h + self.mlp(self.ln2(h))


class BasicTETransformerLayer(BasicTransformerLayer):
    """Step 2: ``nn.Linear`` -> ``te.Linear``, ``nn.LayerNorm`` -> ``te.LayerNorm`` (same parameter names)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_heads: int, eps: float = 1e-5):
        super().__init__(hidden_size, ffn_hidden_size, num_heads, eps)
        self.ln1 = te.LayerNorm(hidden_size, eps=eps)
        self.qkv_projection = te.Linear(hidden_size, 3 * hidden_size)
        self.projection = te.Linear(hidden_size, hidden_size)
        self.ln2 = te.LayerNorm(hidden_size, eps=eps)
        self.mlp.linear1 = te.Linear(hidden_size, ffn_hidden_size)
        self.mlp.linear2 = te.Linear(ffn_hidden_size, hidden_size)


class FusedTETransformerLayer(torch.nn.Module):
    """Step 3: norm + GEMM fused: ``te.LayerNormLinear`` for LN1 + QKV, ``te.LayerNormMLP`` for LN2 + MLP."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_heads: int, eps: float = 1e-5):
        super().__init__()
        self.num_heads = num_heads
        self.ln_qkv = te.LayerNormLinear(hidden_size, 3 * hidden_size, eps=eps)
        self.projection = te.Linear(hidden_size, hidden_size)
        self.ln_mlp = te.LayerNormMLP(hidden_size, ffn_hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.projection(causal_attention(self.ln_qkv(x), self.num_heads))
        return h + self.ln_mlp(h)


def _parameter_map() -> Dict[str, Dict[str, str]]:
    """For each later step: its parameter name -> the basic layer's parameter name."""
    basic = {
        "ln1.weight": "ln1.weight", "ln1.bias": "ln1.bias", "ln2.weight": "ln2.weight", "ln2.bias": "ln2.bias",
        "qkv_projection.weight": "qkv_projection.weight", "qkv_projection.bias": "qkv_projection.bias",
        "projection.weight": "projection.weight", "projection.bias": "projection.bias",
        "mlp.linear1.weight": "mlp.linear1.weight", "mlp.linear1.bias": "mlp.linear1.bias",
        "mlp.linear2.weight": "mlp.linear2.weight", "mlp.linear2.bias": "mlp.linear2.bias",
    }
    mlp = {"layer_norm_weight": "ln2.weight", "layer_norm_bias": "ln2.bias", "fc1_weight": "mlp.linear1.weight",
           "fc1_bias": "mlp.linear1.bias", "fc2_weight": "mlp.linear2.weight", "fc2_bias": "mlp.linear2.bias"}
    qkv = {"layer_norm_weight": "ln1.weight", "layer_norm_bias": "ln1.bias", "weight": "qkv_projection.weight",
           "bias": "qkv_projection.bias"}
    fused = {f"ln_qkv.{k}": v for k, v in qkv.items()}
    fused.update({f"ln_mlp.{k}": v for k, v in mlp.items()})
    fused.update({"projection.weight": "projection.weight", "projection.bias": "projection.bias"})
    layer = {f"self_attention.layernorm_qkv.{k}": v for k, v in qkv.items()}
    layer.update({f"layernorm_mlp.{k}": v for k, v in mlp.items()})
    layer.update({"self_attention.proj.weight": "projection.weight", "self_attention.proj.bias": "projection.bias"})
    return {"basic_te": basic, "fused_te": fused, "te_layer": layer}


def make_layers(hidden_size: int = 64, ffn_hidden_size: int = 256, num_heads: int = 4) -> Dict[str, torch.nn.Module]:
    """The four layers with the basic layer's parameters copied into the three TE versions."""
    layers = {
        "basic": BasicTransformerLayer(hidden_size, ffn_hidden_size, num_heads),
        "basic_te": BasicTETransformerLayer(hidden_size, ffn_hidden_size, num_heads),
        "fused_te": FusedTETransformerLayer(hidden_size, ffn_hidden_size, num_heads),
        "te_layer": te.TransformerLayer(hidden_size, ffn_hidden_size, num_heads, hidden_dropout=0.0, attention_dropout=0.0,
                                        fuse_qkv_params=True, qkv_weight_interleaved=True),
    }
    source = dict(layers["basic"].named_parameters())
    with torch.no_grad():
        for name, mapping in _parameter_map().items():
            for param_name, param in layers[name].named_parameters():
                param.copy_(source[mapping[param_name]])
    return layers


def compare(layers: Dict[str, torch.nn.Module], x: torch.Tensor, fp8: bool = False):
    """{name: (output, input grad, {basic parameter name: grad})} for each layer (TE layers in FP8 if asked)."""
    results = {}
    for name, layer in layers.items():
        inp = x.detach().clone().requires_grad_(requires_grad=True)
        with te.autocast(enabled=fp8 and name != "basic", recipe=DelayedScaling()):
            out = layer(inp)
        out.backward(torch.ones_like(out))
        mapping = _parameter_map().get(name, {n: n for n, _ in layer.named_parameters()})
        grads = {mapping[n]: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        results[name] = (out.detach(), inp.grad, grads)
    return results


def main() -> None:
    torch.manual_seed(0)
    layers = make_layers()
    x = torch.randn(16, 2, 64)  # [sequence, batch, hidden]
    for fp8 in (False, True):
        results = compare(layers, x, fp8=fp8)
        out0, dx0, grads0 = results["basic"]
        print(f"{'FP8 (DelayedScaling)' if fp8 else 'high precision'}: max |difference| to the plain PyTorch layer")
        for name, (out, dx, grads) in results.items():
            dw = max((grads[k] - grads0[k]).abs().max().item() for k in grads0)
            print(f"  {name:10s} output {(out - out0).abs().max().item():.2e}  dx {(dx - dx0).abs().max().item():.2e}  dW {dw:.2e}")


if __name__ == "__main__":
    main()
