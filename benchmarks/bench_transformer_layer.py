"""The headline benchmark of PERF.md: one Transformer layer, fwd+bwd, plain PyTorch vs TE-FL variants.

Layer: hidden 4096, FFN 16384, 32 heads, sequence 2048, batch 4, input [s, b, h], causal
self-attention, dropout 0.1 (the modules' default), bf16 parameters. Each variant runs forward and
backward with a random dy; the table gives the median time, the ratio to the plain layer measured
in the same process, model TFLOP/s (causal attention counted as half) and peak memory. MXFP8 and NVFP4
run emulated (quantize-dequantize, then a high-precision GEMM): their target is the time of the bf16 layer.

On a GPU, four variants are also captured with ``te.make_graphed_callables`` (plain, bf16, FP8
delayed and current): the same GPU work without the host's launch overhead. The plain layer is timed twice,
before and after ``import transformer_engine.pytorch``, and the global PyTorch flags are compared:
importing TE-FL must change neither.

    python benchmarks/bench_transformer_layer.py --json out.json            # H200
    python benchmarks/bench_transformer_layer.py --small                    # quick CPU smoke run
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from _harness import backend_policy, base_parser, fwd_bwd_step, peak_memory, print_table, time_fn, write_json


@dataclass(frozen=True)
class LayerShape:
    hidden: int = 4096
    ffn: int = 16384
    heads: int = 32
    seq: int = 2048
    batch: int = 4

    def flops(self) -> float:
        """Model FLOPs of fwd+bwd (3 x forward): 4 GEMMs + causal attention (half of s^2)."""
        tokens = self.seq * self.batch
        gemm = 2 * tokens * self.hidden * (3 * self.hidden + self.hidden + 2 * self.ffn)
        attention = 2 * 2 * self.batch * self.seq * self.seq * self.hidden / 2
        return 3 * (gemm + attention)


SMALL = LayerShape(hidden=256, ffn=1024, heads=4, seq=128, batch=2)


def torch_flags() -> dict:
    """The global PyTorch settings an import must not change."""
    b = torch.backends
    return {
        "flash_sdp": b.cuda.flash_sdp_enabled(),
        "mem_efficient_sdp": b.cuda.mem_efficient_sdp_enabled(),
        "math_sdp": b.cuda.math_sdp_enabled(),
        "cudnn_sdp": getattr(b.cuda, "cudnn_sdp_enabled", lambda: None)(),
        "matmul_tf32": b.cuda.matmul.allow_tf32,
        "cudnn_tf32": b.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


class PlainLayer(nn.Module):
    """Pre-LN GPT block in plain PyTorch with SDPA (the baseline). ``linear``/``norm`` pick the classes."""

    def __init__(self, s: LayerShape, linear=nn.Linear, norm=nn.LayerNorm, dtype=torch.bfloat16, device="cuda"):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.heads = s.heads
        self.ln1 = norm(s.hidden, eps=1e-5, **_kwargs(norm, kw))
        self.qkv = linear(s.hidden, 3 * s.hidden, **_kwargs(linear, kw))
        self.proj = linear(s.hidden, s.hidden, **_kwargs(linear, kw))
        self.ln2 = norm(s.hidden, eps=1e-5, **_kwargs(norm, kw))
        self.fc1 = linear(s.hidden, s.ffn, **_kwargs(linear, kw))
        self.fc2 = linear(s.ffn, s.hidden, **_kwargs(linear, kw))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, self.heads, 3, -1).permute(3, 1, 2, 0, 4)  # 3 x [b, h, s, d]
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        return self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.attention(self.ln1(x)), 0.1, self.training)
        return h + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh")), 0.1, self.training)


def _kwargs(cls, kw):
    """TE's linear modules name the parameter dtype ``params_dtype``; torch modules and TE's norms ``dtype``
    (TE deprecates ``params_dtype`` on ``LayerNorm`` / ``RMSNorm``)."""
    if cls.__module__.startswith("transformer_engine") and cls.__name__ not in ("LayerNorm", "RMSNorm"):
        return dict(device=kw["device"], params_dtype=kw["dtype"])
    return kw


class FusedModulesLayer(nn.Module):
    """The same block from te.LayerNormLinear + te.LayerNormMLP (attention through SDPA)."""

    def __init__(self, s: LayerShape, te, dtype=torch.bfloat16, device="cuda"):
        super().__init__()
        kw = dict(params_dtype=dtype, device=device)
        self.heads = s.heads
        self.ln_qkv = te.LayerNormLinear(s.hidden, 3 * s.hidden, eps=1e-5, **kw)
        self.proj = te.Linear(s.hidden, s.hidden, **kw)
        self.mlp = te.LayerNormMLP(s.hidden, s.ffn, eps=1e-5, activation="gelu", **kw)

    def forward(self, x):
        s, b, _ = x.shape
        q, k, v = self.ln_qkv(x).view(s, b, self.heads, 3, -1).permute(3, 1, 2, 0, 4)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        h = x + F.dropout(self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1)), 0.1, self.training)
        return h + F.dropout(self.mlp(h), 0.1, self.training)


def measure(layer: nn.Module, s: LayerShape, context_factory, iters: int, graph: Optional[dict] = None) -> dict:
    """Time and peak memory of fwd+bwd; ``graph``: capture the layer with ``te.make_graphed_callables(**graph)``
    first (its FP8 setting is then part of the graph, and the step runs outside any autocast)."""
    device = next(layer.parameters()).device
    x = torch.randn(s.seq, s.batch, s.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    if graph is not None:
        import transformer_engine.pytorch as te

        layer = te.make_graphed_callables(layer, (x,), **graph)

    step = fwd_bwd_step(layer, x, dy, context_factory)
    ms = time_fn(step, warmup=5, iters=iters, device=device)
    mem = None if graph is not None else peak_memory(step)  # a replay allocates nothing: its pool is not counted
    return {"ms": ms, "peak_bytes": mem, "tflops": s.flops() / ms / 1e9}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shape (CPU smoke test)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph variants (GPU only)")
    args = parser.parse_args()
    s = SMALL if args.small else LayerShape()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import contextlib

    none = contextlib.nullcontext
    results = {}
    torch.manual_seed(0)
    flags_before = torch_flags()
    results["plain PyTorch (before TE import)"] = measure(PlainLayer(s, device=device), s, none, args.iters)

    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    flags_after = torch_flags()
    variants = {
        "plain PyTorch": lambda: (PlainLayer(s, device=device), none),
        "te.Linear + te.LayerNorm": lambda: (PlainLayer(s, te.Linear, te.LayerNorm, device=device), none),
        "te.LayerNormLinear + te.LayerNormMLP": lambda: (FusedModulesLayer(s, te, device=device), none),
        "te.TransformerLayer bf16": lambda: (_te_layer(te, s, device), none),
    }
    fp8_recipes = {
        "te.TransformerLayer FP8 delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                                                 amax_compute_algo="max"),
        "te.TransformerLayer FP8 current": recipe.Float8CurrentScaling(),
        "te.TransformerLayer FP8 block": recipe.Float8BlockScaling(),
        "te.TransformerLayer MXFP8 (emulated)": recipe.MXFP8BlockScaling(),
        "te.TransformerLayer NVFP4 (emulated)": recipe.NVFP4BlockScaling(),
    }
    for name, rec in fp8_recipes.items():
        variants[name] = (lambda rec=rec: (_te_layer(te, s, device), lambda: te.autocast(recipe=rec)))
    graphs = {}  # variant -> make_graphed_callables arguments
    if device == "cuda" and not args.no_graphs:
        delayed = fp8_recipes["te.TransformerLayer FP8 delayed"]
        graphs = {
            "plain PyTorch, CUDA graph": ("plain PyTorch", {}),
            "te.TransformerLayer bf16, CUDA graph": ("te.TransformerLayer bf16", {}),
            "te.TransformerLayer FP8 delayed, CUDA graph": ("te.TransformerLayer FP8 delayed", dict(enabled=True, recipe=delayed)),
            "te.TransformerLayer FP8 current, CUDA graph": (
                "te.TransformerLayer FP8 current", dict(enabled=True, recipe=fp8_recipes["te.TransformerLayer FP8 current"])),
        }
    with backend_policy(args.backend):
        for name in list(variants) + list(graphs):
            eager, graph = graphs.get(name, (name, None))
            try:
                layer, ctx = variants[eager]()
                results[name] = measure(layer, s, ctx, args.iters, graph)
            except Exception as exc:  # a recipe this hardware or build cannot run is reported, not fatal
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                layer = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    print_table(f"TransformerLayer fwd+bwd {s} on {device} (backend: {args.backend})", *table(results, device == "cuda"))
    changed = {k: (flags_before[k], flags_after[k]) for k in flags_before if flags_before[k] != flags_after[k]}
    print("global PyTorch flags changed by the import:", changed or "none")
    write_json(args.json, {"shape": s.__dict__, "results": results, "flags_changed_by_import": changed})


def table(results: dict, on_gpu: bool):
    """(headers, rows) of the results. On a CPU only time and the ratio to plain PyTorch: a tiny shape's
    TFLOP/s rounds to 0 and peak memory is CUDA's, so those columns would say nothing."""
    headers = ["variant", "ms", "vs plain"] + (["TFLOP/s", "peak GiB", "mem vs plain"] if on_gpu else [])
    base = results["plain PyTorch"]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "n/a", ""] + ([""] * 3 if on_gpu else []) + [r["error"][:80]])
            continue
        row = [name, f"{r['ms']:.2f}", f"{r['ms'] / base['ms']:.2f}x"]
        if on_gpu:
            mem = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f}"
            mem_ratio = "" if r["peak_bytes"] is None or base.get("peak_bytes") is None else f"{r['peak_bytes'] / base['peak_bytes']:.2f}x"
            row += [f"{r['tflops']:.0f}", mem, mem_ratio]
        rows.append(row)
    if any("error" in r for r in results.values()):
        headers = headers + ["error"]
        rows = [row + [""] * (len(headers) - len(row)) for row in rows]
    return headers, rows


def _te_layer(te, s: LayerShape, device: str):
    return te.TransformerLayer(s.hidden, s.ffn, s.heads, params_dtype=torch.bfloat16, device=device,
                               self_attn_mask_type="causal")


if __name__ == "__main__":
    main()
