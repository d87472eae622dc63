"""Quickstart: TE-FL modules in high precision and in FP8 with delayed scaling.

Shows how to
- build ``te.LayerNorm``, ``te.Linear`` and ``te.TransformerLayer``;
- run forward and backward in high precision, then the same under
  ``te.autocast(recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16))``
  (E4M3 forward, E5M2 gradients);
- measure how far FP8 is from high precision: SQNR = 20 log10(||y_hp|| / ||y_hp - y_fp8||) in dB;
- read the FP8 scaling state of a module, ``fp8_meta["scaling_fwd"].scale`` (one slot per tensor
  role: input, weight, output of each GEMM) and ``fp8_meta["scaling_bwd"].scale`` (grad output,
  grad input).

Delayed scaling casts with the scale of the previous steps, so the first FP8 step runs with scale 1
and the scales settle after the first update (when the outermost autocast exits). The example
therefore runs a few FP8 steps and compares the last one.

Runs on the CPU (FP8 emulated by the reference backend) or on a GPU with FP8 support; from the
repository root, after ``pip install -e .`` (or with ``PYTHONPATH=.``):

    python examples/quickstart.py                      # small shapes, a few seconds on CPU
    python examples/quickstart.py --device cuda --hidden 1024 --ffn 4096 --heads 16 --seq 512
"""

import argparse
import math
from collections import OrderedDict

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (FP8 needs a multiple of 16)")
    parser.add_argument("--ffn", type=int, default=128, help="MLP hidden size of the TransformerLayer")
    parser.add_argument("--heads", type=int, default=4, help="attention heads of the TransformerLayer")
    parser.add_argument("--seq", type=int, default=16, help="sequence length (seq * batch must be a multiple of 8)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--fp8-steps", type=int, default=3, help="FP8 steps before comparing")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.fp8_steps < 1:
        parser.error(f"--fp8-steps={args.fp8_steps} must be >= 1")
    return args


def sqnr_db(reference, actual):
    """SQNR in dB: 20 log10(||reference|| / ||reference - actual||), infinite for equal tensors."""
    noise = (reference.double() - actual.double()).norm().item()
    return math.inf if noise == 0 else 20.0 * math.log10(reference.double().norm().item() / noise)


def forward_backward(model, x, recipe=None):
    """Output and input gradient of one step (loss = sum of outputs); FP8 forward when ``recipe`` is given."""
    x = x.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    y.float().sum().backward()  # backward outside autocast; it reuses the forward's FP8 settings
    return y.detach(), x.grad.detach()


def compare(name, model, x, recipe, fp8_steps):
    """Run ``model`` in high precision, then ``fp8_steps`` times with FP8; print the SQNRs of the last."""
    y_hp, dx_hp = forward_backward(model, x)
    for _ in range(fp8_steps):
        y_fp8, dx_fp8 = forward_backward(model, x, recipe)
    print(f"== {name}: output {tuple(y_hp.shape)}")
    print(f"   output   FP8 vs high precision: SQNR {sqnr_db(y_hp, y_fp8):6.1f} dB, "
          f"max abs diff {(y_hp - y_fp8).abs().max().item():.3e}")
    print(f"   grad in  FP8 vs high precision: SQNR {sqnr_db(dx_hp, dx_fp8):6.1f} dB, "
          f"max abs diff {(dx_hp - dx_fp8).abs().max().item():.3e}")


def _fmt(tensor):
    return "[" + ", ".join(f"{v:.4g}" for v in tensor.tolist()) + "]"


def print_scaling_state(model):
    """Print ``fp8_meta[...].scale`` of every submodule that runs FP8 GEMMs."""
    for fqn, module in model.named_modules():
        meta = getattr(module, "fp8_meta", None)
        if not meta or meta.get("scaling_fwd") is None:  # norms run no GEMM: no scaling state
            continue
        label = fqn or type(module).__name__
        print(f'   {label}.fp8_meta["scaling_fwd"].scale = {_fmt(meta["scaling_fwd"].scale)}')
        print(f'   {label}.fp8_meta["scaling_bwd"].scale = {_fmt(meta["scaling_bwd"].scale)}')


def main():
    args = _parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    print(f"device {device}; recipe DelayedScaling(fp8_format={recipe.fp8_format.name}, "
          f"amax_history_len={recipe.amax_history_len})")

    # 1. A LayerNorm followed by a Linear, on tokens of shape [tokens, hidden].
    norm_linear = torch.nn.Sequential(
        OrderedDict(
            norm=te.LayerNorm(args.hidden, eps=1e-5, device=device),
            linear=te.Linear(args.hidden, args.hidden, bias=True, device=device),
        )
    )
    tokens = torch.randn(args.seq * args.batch, args.hidden, device=device)
    compare("te.LayerNorm -> te.Linear", norm_linear, tokens, recipe, args.fp8_steps)
    print_scaling_state(norm_linear)

    # 2. A whole transformer layer on [seq, batch, hidden] (TE's default "sbhd" layout).
    layer = te.TransformerLayer(
        args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0, device=device
    )
    hidden_states = torch.randn(args.seq, args.batch, args.hidden, device=device)
    compare("te.TransformerLayer", layer, hidden_states, recipe, args.fp8_steps)
    print_scaling_state(layer)
    print("quickstart done")


if __name__ == "__main__":
    main()
