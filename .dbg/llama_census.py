"""Census of the HF Llama step through Accelerate (bench_accelerate_llama's model): kernels per step by name, host ms.

python .dbg/llama_census.py [variants: bf16:no,fp8:no,bf16:inductor,fp8:inductor]"""
import collections, sys, time
sys.path.insert(0, "benchmarks")
import torch
from bench_accelerate_llama import _fp8_handlers, _reset_accelerate


def build(mixed_precision, dynamo_backend, tokens=2048):
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

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def census(label):
    mp, backend = label.split(":")
    step = build(mp, backend)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    hosts = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter(); step(); hosts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    names = collections.Counter()
    gpu_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name[:70]] += 1
            gpu_us += e.device_time if hasattr(e, "device_time") else e.cuda_time
    total = sum(names.values()) / 3
    hosts.sort()
    print(f"=== {label}: step {wall * 1e3:.2f} ms, host (enqueue from idle) median {hosts[5] * 1e3:.2f} ms, kernels/step {total:.0f}, GPU {gpu_us / 3e3:.2f} ms")
    for name, n in names.most_common(40):
        print(f"  {n / 3:6.1f}  {name}")
    torch._dynamo.reset()


for label in (sys.argv[1] if len(sys.argv) > 1 else "bf16:no,fp8:no,bf16:inductor,fp8:inductor").split(","):
    try:
        census(label)
    except Exception as exc:  # noqa: BLE001
        print(f"=== {label}: {type(exc).__name__}: {str(exc)[:300]}")
