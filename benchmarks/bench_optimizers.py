"""FusedAdam against torch.optim.AdamW(fused=True): one optimizer step over many parameters.

The parameters are a transformer-like mix of tensors (square weights, 4x MLP weights, vectors) adding up
to ``--params`` elements. Variants: float32 parameters (both optimizers), and bf16 parameters with fp32
master weights (FusedAdam ``master_weights=True``; torch has no such mode: its row is AdamW(fused=True)
stepping the fp32 masters, plus the bf16 copy, as a mixed-precision framework would run it), and FP8
parameters (``quantized_model_init`` under Float8CurrentScaling: the matrices stored as Float8Tensors, the
vectors bf16) with fp32 master weights (FusedAdam re-quantizes each FP8 parameter from its master). Columns:
median ms of a step (gradients already in place), the ratio FusedAdam / torch, and the bytes per parameter of
the parameters and of the optimizer state. ``--memory-only`` counts the bytes alone (any device, no timing).
Writes JSON with ``--json``.

    python benchmarks/bench_optimizers.py --params 1e9 --json optim.json
    python benchmarks/bench_optimizers.py --params 2e7 --memory-only --device cpu
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from _harness import backend_policy, base_parser, print_table, time_fn, write_json


def _shapes(total: int, hidden: int = 4096) -> List[tuple]:
    """Layer-like shapes (q/k/v/o [h, h], fc1 [4h, h], fc2 [h, 4h], two norms [h]) until ``total`` elements."""
    layer = [(hidden, hidden)] * 4 + [(4 * hidden, hidden), (hidden, 4 * hidden), (hidden,), (hidden,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    return layer * max(1, round(total / per_layer))


def _params(shapes, dtype, device) -> List[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _fp8_params(shapes, device) -> List[torch.nn.Parameter]:
    """The matrices as FP8 parameters (one ``te.Linear`` weight each, built under ``quantized_model_init``), the
    vectors bf16; gradients bf16."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    params = []
    for shape in shapes:
        if len(shape) == 1:
            params += _params([shape], torch.bfloat16, device)
            continue
        with te.quantized_model_init(recipe=Float8CurrentScaling()):
            weight = te.Linear(shape[1], shape[0], bias=False, params_dtype=torch.bfloat16, device=device).weight
        weight.grad = torch.randn(shape, device=device, dtype=torch.bfloat16) * 1e-3
        params.append(weight)
    return params


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: its storage, or for a quantized tensor its buffers (data, scales, transposes)."""
    from transformer_engine.pytorch.tensor.quantized_tensor import QuantizedTensor

    if isinstance(t, QuantizedTensor):
        return sum(_tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _state_bytes(optimizer) -> int:
    return sum(_tensor_bytes(t) for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _param_bytes(optimizer) -> int:
    return sum(_tensor_bytes(p) for group in optimizer.param_groups for p in group["params"])


def _variants(shapes, device) -> Dict[str, Dict[str, Callable]]:
    from transformer_engine.pytorch.optimizers import FusedAdam

    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def fp32_torch():
        return torch.optim.AdamW(_params(shapes, torch.float32, device), fused=True, **hyper), None

    def fp32_ours():
        return FusedAdam(_params(shapes, torch.float32, device), adam_w_mode=True, **hyper), None

    def bf16_torch():
        params = _params(shapes, torch.bfloat16, device)
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        optimizer = torch.optim.AdamW(masters, fused=True, **hyper)

        def copy_back():
            torch._foreach_copy_([p.data for p in params], [m.data for m in masters])

        return optimizer, copy_back

    def bf16_ours():
        return FusedAdam(_params(shapes, torch.bfloat16, device), adam_w_mode=True, master_weights=True, **hyper), None

    def fp8_ours():
        return FusedAdam(_fp8_params(shapes, device), adam_w_mode=True, master_weights=True, **hyper), None

    return {"fp32": {"torch AdamW(fused=True)": fp32_torch, "te FusedAdam": fp32_ours},
            "bf16 + fp32 master": {"torch AdamW(fused=True) + copy": bf16_torch, "te FusedAdam(master_weights)": bf16_ours},
            "FP8 + fp32 master": {"te FusedAdam(master_weights)": fp8_ours}}


def _measure(optimizer, after, timed: bool) -> tuple:
    """(median ms of ``optimizer.step()`` followed by ``after()`` or None when not ``timed``, the bytes of the
    parameters, of the optimizer's state); the state exists after one step."""

    def step():
        optimizer.step()
        if after is not None:
            after()

    ms = time_fn(step, warmup=3, iters=10) if timed else step()
    return ms, _param_bytes(optimizer), _state_bytes(optimizer)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameter count (elements)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size of the layer-like shapes")
    parser.add_argument("--memory-only", action="store_true", help="count the bytes per parameter only (no timing)")
    parser.add_argument("--device", default="cuda", help="where the parameters live (cpu only with --memory-only)")
    args = parser.parse_args()
    if not args.memory_only and not (args.device == "cuda" and torch.cuda.is_available()):
        raise SystemExit("bench_optimizers.py times GPU optimizers: it needs --device cuda and a CUDA GPU (or --memory-only)")
    shapes = _shapes(int(args.params), args.hidden)
    count = sum(torch.Size(s).numel() for s in shapes)
    rows, results = [], []
    with backend_policy(args.backend):
        for setting, variants in _variants(shapes, args.device).items():
            baseline_ms = None
            for name, build in variants.items():  # torch first (where there is one): the baseline of the speed-up
                ms, params, state = _measure(*build(), timed=not args.memory_only)
                baseline_ms = baseline_ms or ms
                speedup = None if ms is None else baseline_ms / ms
                results.append({"setting": setting, "optimizer": name, "ms": ms, "speedup": speedup,
                                "param_bytes_per_param": params / count, "state_bytes_per_param": state / count})
                rows.append([setting, name, "-" if ms is None else f"{ms:.2f}", "-" if speedup is None else f"{speedup:.2f}x",
                             f"{params / count:.2f}", f"{state / count:.2f}"])
                if args.device == "cuda":
                    torch.cuda.empty_cache()  # the optimizer and its tensors are gone with _measure's frame
    print_table(f"Adam step over {count / 1e9:.3f}B parameters on {args.device} (speed-up: torch ms / ours)",
                ["setting", "optimizer", "ms", "speed-up", "params B/param", "state B/param"], rows)
    write_json(args.json, {"params": count, "results": results})


if __name__ == "__main__":
    main()
