"""A HF transformers Llama trained through HF Accelerate: FP8 (our package as Accelerate's TE backend) vs bf16.

The client case of the issue "Speed at the sizes people train": hidden 1024, 4 layers, 16 heads with 4 KV
heads (GQA), 2048 tokens a step, AdamW. Variants: ``mixed_precision`` "bf16" or "fp8" (Accelerate's
TransformerEngine path: ``convert_model`` swaps ``nn.Linear`` for ``te.Linear`` and every forward runs
inside ``te.fp8_autocast`` with DelayedScaling), each eager, with ``dynamo_backend="inductor"``
(``torch.compile`` of the model) and with ``dynamo_backend="inductor"`` under Inductor's C++ wrapper
(label ``inductor+cpp``: ``TORCHINDUCTOR_CPP_WRAPPER=1`` in a user's environment, the same kernels launched
from generated C++). Everything is Accelerate's default otherwise, as its users run it.

Columns: median ms of a training step (forward, backward, optimizer step; CUDA events), FP8 / bf16 of
the same mode, the host ms to enqueue one step from an idle GPU, and the kernels a step launches (the census
of ``profile_layer.kernel_table`` over 3 steps; the JSON lists the most frequent kernels by name, where the
compiled FP8 step's per-module bookkeeping shows). Needs a CUDA GPU with transformers and accelerate installed, and this package installed
(``pip install --no-deps -e .``: Accelerate reads its version).

Usage: python benchmarks/bench_accelerate_llama.py [--steps 20] [--json out.json]
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch

from _harness import base_parser, host_ms, print_table, time_fn, write_json
from profile_layer import kernel_table


def _reset_accelerate() -> None:
    """Accelerate keeps its state in process-wide singletons; each variant starts from a clean one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _fp8_handlers() -> list:
    import accelerate.utils as utils

    if hasattr(utils, "TERecipeKwargs"):
        return [utils.TERecipeKwargs()]
    return [utils.FP8RecipeKwargs(backend="TE")]


def _inductor_wrapper(label: str):
    """(Accelerate's dynamo_backend, context): ``inductor+cpp`` is Inductor with its C++ wrapper, set while the
    model compiles and runs (as ``TORCHINDUCTOR_CPP_WRAPPER=1`` would for the whole process)."""
    if label != "inductor+cpp":
        return label, contextlib.nullcontext()
    from torch._inductor import config

    return "inductor", config.patch(cpp_wrapper=True)


def measure(mixed_precision: str, label: str, steps: int, tokens: int) -> Dict[str, object]:
    dynamo_backend, wrapper = _inductor_wrapper(label)
    with wrapper:
        return _measure(mixed_precision, dynamo_backend, steps, tokens) | {"dynamo_backend": label}


def _measure(mixed_precision: str, dynamo_backend: str, steps: int, tokens: int) -> Dict[str, object]:
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    _reset_accelerate()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=tokens)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accelerator = Accelerator(mixed_precision=mixed_precision, dynamo_backend=dynamo_backend,
                              kwargs_handlers=_fp8_handlers() if mixed_precision == "fp8" else None)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=accelerator.device)
    losses: List[float] = []

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    ms = time_fn(step, warmup=5, iters=steps, device=accelerator.device)
    kernels, gpu_us, _ = kernel_table(step, accelerator.device.type)
    census = sorted(((calls, name) for name, (_, calls) in kernels.items()), reverse=True)
    return {"mixed_precision": mixed_precision, "dynamo_backend": dynamo_backend, "ms": ms,
            "host_ms": host_ms(step, accelerator.device.type), "kernels_per_step": sum(calls for calls, _ in census),
            "gpu_busy_ms": gpu_us / 1e3, "top_kernels": [[name, calls] for calls, name in census[:25]],
            "te_linears": sum(type(m).__module__.startswith("transformer_engine") for m in accelerator.unwrap_model(model).modules()),
            "last_loss": float(losses[-1])}


def _choices(text: str, known: tuple, flag: str) -> list:
    """The comma-separated names of ``text``, each one of ``known`` (SystemExit naming the others)."""
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise SystemExit(f"{flag} {text!r}: pick from {', '.join(known)}")
    return names


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--backends", default="no,inductor,inductor+cpp", help="comma-separated dynamo backends to time")
    parser.add_argument("--precisions", default="bf16,fp8", help="comma-separated mixed precisions to time")
    args = parser.parse_args()
    rows = []
    for dynamo_backend in _choices(args.backends, ("no", "inductor", "inductor+cpp"), "--backends"):
        for mixed_precision in _choices(args.precisions, ("bf16", "fp8"), "--precisions"):
            try:
                rows.append(measure(mixed_precision, dynamo_backend, args.steps, args.tokens))
            except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
                rows.append({"mixed_precision": mixed_precision, "dynamo_backend": dynamo_backend,
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
            print(rows[-1], flush=True)
            torch._dynamo.reset()
    base = {r["dynamo_backend"]: r.get("ms") for r in rows if r["mixed_precision"] == "bf16"}
    for r in rows:
        r["fp8_over_bf16"] = r["ms"] / base[r["dynamo_backend"]] if r.get("ms") and base.get(r["dynamo_backend"]) else None
    print_table("HF Llama (hidden 1024, 4 layers, GQA) through HF Accelerate, one training step",
                ["mixed_precision", "dynamo_backend", "ms", "fp8 / bf16", "host ms", "kernels / step", "te modules", "loss"],
                [[r["mixed_precision"], r["dynamo_backend"], f"{r['ms']:.2f}" if "ms" in r else r.get("error", ""),
                  f"{r['fp8_over_bf16']:.2f}x" if r.get("fp8_over_bf16") else "", f"{r['host_ms']:.2f}" if "host_ms" in r else "",
                  r.get("kernels_per_step", ""), r.get("te_linears", ""),
                  f"{r['last_loss']:.3f}" if "last_loss" in r else ""] for r in rows])
    write_json(args.json, {"results": rows})


if __name__ == "__main__":
    main()
