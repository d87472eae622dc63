"""FusedAdam against torch.optim.AdamW(fused=True): one optimizer step over many parameters.

The parameters are a transformer-like mix of tensors (square weights, 4x MLP weights, vectors) adding up
to ``--params`` elements. Variants: float32 parameters (both optimizers), and bf16 parameters with fp32
master weights (FusedAdam ``master_weights=True``; torch has no such mode: its row is AdamW(fused=True)
stepping the fp32 masters, plus the bf16 copy, as a mixed-precision framework would run it). Columns:
median ms of a step (gradients already in place), the ratio FusedAdam / torch, and the optimizer state
bytes per parameter. Writes JSON with ``--json``.

    python benchmarks/bench_optimizers.py --params 1e9 --json optim.json
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from _harness import backend_policy, base_parser, print_table, time_fn, write_json

HIDDEN = 4096


def _shapes(total: int) -> List[tuple]:
    """Layer-like shapes (q/k/v/o [h, h], fc1 [4h, h], fc2 [h, 4h], two norms [h]) until ``total`` elements."""
    layer = [(HIDDEN, HIDDEN)] * 4 + [(4 * HIDDEN, HIDDEN), (HIDDEN, 4 * HIDDEN), (HIDDEN,), (HIDDEN,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    return layer * max(1, round(total / per_layer))


def _params(shapes, dtype, device) -> List[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


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

    return {"fp32": {"torch AdamW(fused=True)": fp32_torch, "te FusedAdam": fp32_ours},
            "bf16 + fp32 master": {"torch AdamW(fused=True) + copy": bf16_torch, "te FusedAdam(master_weights)": bf16_ours}}


def _measure(optimizer, after) -> tuple:
    """(median ms of ``optimizer.step()`` followed by ``after()``, the optimizer's state bytes)."""

    def step():
        optimizer.step()
        if after is not None:
            after()

    return time_fn(step, warmup=3, iters=10), _state_bytes(optimizer)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9, help="parameter count (elements)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_optimizers.py times GPU optimizers: it needs a CUDA GPU")
    shapes = _shapes(int(args.params))
    count = sum(torch.Size(s).numel() for s in shapes)
    rows, results = [], []
    with backend_policy(args.backend):
        for setting, variants in _variants(shapes, "cuda").items():
            baseline_ms = None
            for name, build in variants.items():  # torch first: the baseline of the speed-up
                ms, state = _measure(*build())
                baseline_ms = baseline_ms or ms
                results.append({"setting": setting, "optimizer": name, "ms": ms, "speedup": baseline_ms / ms,
                                "state_bytes_per_param": state / count})
                rows.append([setting, name, f"{ms:.2f}", f"{baseline_ms / ms:.2f}x", f"{state / count:.1f}"])
                torch.cuda.empty_cache()  # the optimizer and its tensors are gone with _measure's frame
    print_table(f"Adam step over {count / 1e9:.2f}B parameters (speed-up: torch ms / ours)",
                ["setting", "optimizer", "ms", "speed-up", "state B/param"], rows)
    write_json(args.json, {"params": count, "results": results})


if __name__ == "__main__":
    main()
