"""Mixture-of-experts pieces against plain PyTorch: GroupedLinear and parallel_cross_entropy.

- ``te.GroupedLinear`` (8 experts, uneven splits of 16384 tokens, 4096 -> 4096), fwd+bwd, bf16 and FP8
  (delayed scaling in the HYBRID and E4M3 formats, current scaling), with and without biases, against a loop
  of bf16 ``nn.Linear`` over the same splits; the "time-rate" is the loop's time over ours, of a step from an idle
  GPU (the host's time to issue it shows) and of steps back to back (a training loop's steady state).
- ``te.parallel_cross_entropy`` on one GPU (vocab 131072, 8192 tokens, bf16 logits), fwd+bwd, against
  ``F.cross_entropy`` on the same logits: time and the peak memory a step adds.

    python benchmarks/bench_moe.py --json moe.json
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _harness import base_parser, backend_policy, peak_memory, print_table, time_back_to_back, time_fn, under_autocast, write_json

EXPERTS, TOKENS, HIDDEN = 8, 16384, 4096
SPLITS = [3072, 1024, 2560, 512, 4096, 1536, 2048, 1536]  # uneven, multiples of 16, sum 16384
VOCAB, CE_TOKENS = 131072, 8192


def _recipes():
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    return {
        "bf16": None,
        "fp8 delayed": DelayedScaling(amax_history_len=16),
        "fp8 delayed e4m3": DelayedScaling(fp8_format=Format.E4M3, amax_history_len=16),
        "fp8 current": Float8CurrentScaling(),
    }


def _times(step):
    """(ms of a step from an idle GPU, ms per step back to back: a training loop's steady state)."""
    return time_fn(step, warmup=5, iters=20), time_back_to_back(step, warmup=2, iters=20)


def grouped_linear_rows():
    """Each precision with and without biases (mixture-of-experts layers mostly have none), against the loop of
    ``nn.Linear`` with the same biases."""
    import transformer_engine.pytorch as te

    assert sum(SPLITS) == TOKENS and len(SPLITS) == EXPERTS
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows, results = [], {}
    for bias in (True, False):
        linears = [torch.nn.Linear(HIDDEN, HIDDEN, bias=bias, device="cuda", dtype=torch.bfloat16) for _ in range(EXPERTS)]

        def loop_step():
            y = torch.cat([linear(part) for linear, part in zip(linears, x.split(SPLITS))])
            y.backward(dy)

        baseline = _times(loop_step)
        suffix = "" if bias else " no bias"
        rows.append([f"loop of nn.Linear{suffix}", "bf16", f"{baseline[0]:.3f}", f"{baseline[1]:.3f}", "1.00x", "1.00x"])
        results[f"loop_bf16{suffix.replace(' ', '_')}_ms"] = baseline
        grouped = te.GroupedLinear(EXPERTS, HIDDEN, HIDDEN, bias=bias, params_dtype=torch.bfloat16, device="cuda")
        for name, recipe in _recipes().items():
            forward = under_autocast(lambda inp: grouped(inp, SPLITS), recipe)

            def step():
                forward(x).backward(dy)

            ms = _times(step)
            results[f"grouped_{name}{suffix}_ms".replace(" ", "_")] = ms
            rows.append([f"te.GroupedLinear{suffix}", name, f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{baseline[0] / ms[0]:.2f}x",
                         f"{baseline[1] / ms[1]:.2f}x"])
    return rows, results


def cross_entropy_rows():
    import transformer_engine.pytorch as te

    logits = torch.randn(CE_TOKENS, VOCAB, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, VOCAB, (CE_TOKENS,), device="cuda")

    def torch_step():
        F.cross_entropy(logits.float(), target).backward()  # the usual float32 loss over bf16 logits
        logits.grad = None

    def ours_step():
        te.parallel_cross_entropy(logits, target, reduce_loss=True).sum().backward()
        logits.grad = None

    def added_memory(step) -> int:
        """Peak bytes a step allocates over what exists before it (the logits, their targets)."""
        before = torch.cuda.memory_allocated()
        return peak_memory(step) - before

    rows, results = [], {}
    base_ms, base_mem = time_fn(torch_step, warmup=3, iters=20), added_memory(torch_step)
    for name, step in (("F.cross_entropy (float32)", torch_step), ("te.parallel_cross_entropy", ours_step)):
        ms, mem = time_fn(step, warmup=3, iters=20), added_memory(step)
        results[name] = {"ms": ms, "peak_bytes": mem}
        rows.append([name, f"{ms:.3f}", f"{base_ms / ms:.2f}x", f"{mem / 2**20:.0f}", f"{mem / base_mem:.2f}x"])
    return rows, results


def main() -> None:
    args = base_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe.py times GPU kernels: it needs a CUDA GPU")
    with backend_policy(args.backend):
        gl_rows, gl = grouped_linear_rows()
        ce_rows, ce = cross_entropy_rows()
    print_table(f"GroupedLinear, {EXPERTS} experts, {TOKENS} tokens split {SPLITS}, {HIDDEN} -> {HIDDEN}, fwd+bwd",
                ["module", "precision", "ms from idle", "ms back to back", "time-rate from idle", "time-rate back to back"], gl_rows)
    print_table(f"cross entropy, vocab {VOCAB}, {CE_TOKENS} tokens, bf16 logits, fwd+bwd",
                ["loss", "ms", "speed-up", "step MiB", "memory vs torch"], ce_rows)
    write_json(args.json, {"grouped_linear": gl, "cross_entropy": ce})


if __name__ == "__main__":
    main()
