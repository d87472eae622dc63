"""Convert a plain PyTorch model to TE-FL modules, check it, then train it in FP8.

Shows the module swap that HF Accelerate's ``convert_model`` and Lightning's
``TransformerEnginePrecision`` perform, written out as a short tree walk (:func:`convert_to_te`):

- every ``nn.Linear`` whose dimensions satisfy the FP8 shape rule (in_features % 16 == 0 and
  out_features % 16 == 0) becomes a ``te.Linear``; every ``nn.LayerNorm`` over one dimension with
  weight and bias becomes a ``te.LayerNorm``; parameters are copied under ``torch.no_grad()``;
- a ``module_filter_fn(module, fqn) -> bool`` hook keeps chosen modules as they are (here the LM
  head, commonly left in high precision);
- the converted model gives the original's output in high precision;
- a few AdamW steps of both models on the same data, the converted one with its forward under
  ``te.autocast(recipe=DelayedScaling(...))``; the FP8 loss tracks the high-precision loss.

The model is a tiny GPT: token + position embeddings, pre-LN blocks (causal attention through
``F.scaled_dot_product_attention``, tanh-GELU MLP), final LayerNorm, LM head. ``convert_to_te`` is
part of this example, not library API: copy it and adapt the rules.

Run from the repository root, after ``pip install -e .`` (or with ``PYTHONPATH=.``):

    python examples/convert_model.py                   # small shapes, a few seconds on CPU
    python examples/convert_model.py --device cuda --hidden 512 --layers 4 --seq 256 --steps 50
"""

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Format


# --- a plain PyTorch model ------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LN transformer block on [batch, seq, hidden]: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        batch, seq, hidden = x.shape
        qkv = self.qkv(self.ln_1(x)).view(batch, seq, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, seq, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.ln_2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, vocab, hidden, heads, layers, max_seq):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.pos_emb = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- the conversion -------------------------------------------------------------------------------
def _why_not_linear(linear):
    """None if ``linear`` can run FP8 GEMMs, else why not (both dims must be multiples of 16)."""
    if linear.in_features % 16 or linear.out_features % 16:
        return f"shape {linear.in_features}->{linear.out_features} breaks the FP8 rule (both % 16 == 0)"
    return None


def _why_not_layernorm(norm):
    """None if ``norm`` maps onto te.LayerNorm (one normalized dim, with weight and bias)."""
    if len(norm.normalized_shape) != 1 or norm.weight is None or norm.bias is None:
        return "te.LayerNorm needs one normalized dim with weight and bias"
    return None


def _to_te_linear(linear):
    """A te.Linear holding a copy of ``linear``'s parameters."""
    weight = linear.weight
    new = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    params_dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        new.weight.copy_(weight)
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


def _to_te_layernorm(norm):
    """A te.LayerNorm holding a copy of ``norm``'s parameters."""
    new = te.LayerNorm(norm.normalized_shape[0], eps=norm.eps, dtype=norm.weight.dtype, device=norm.weight.device)
    with torch.no_grad():
        new.weight.copy_(norm.weight)
        new.bias.copy_(norm.bias)
    return new


# exact types: a subclass (e.g. nn.MultiheadAttention's out_proj) may use its weight without calling forward
_RULES = {
    nn.Linear: (_why_not_linear, _to_te_linear, "te.Linear"),
    nn.LayerNorm: (_why_not_layernorm, _to_te_layernorm, "te.LayerNorm"),
}


def convert_to_te(module, module_filter_fn=None, prefix=""):
    """Replace, in place, the nn.Linear / nn.LayerNorm submodules of ``module`` that TE can run.

    Args:
        module: the model (converted in place).
        module_filter_fn: optional ``fn(module, fqn) -> bool``; False keeps that module as it is.
        prefix: fully qualified name of ``module`` plus ``"."`` (used by the recursion).

    Returns:
        {fqn: outcome} for every nn.Linear / nn.LayerNorm met, e.g. ``"-> te.Linear"`` or
        ``"kept: module_filter_fn"``.
    """
    report = {}
    for name, child in module.named_children():
        fqn = prefix + name
        rule = _RULES.get(type(child))
        if rule is None:
            report.update(convert_to_te(child, module_filter_fn, fqn + "."))
            continue
        why_not, swap, te_name = rule
        if module_filter_fn is not None and not module_filter_fn(child, fqn):
            reason = "module_filter_fn"
        else:
            reason = why_not(child)
        if reason is None:
            setattr(module, name, swap(child))
        report[fqn] = f"-> {te_name}" if reason is None else f"kept: {reason}"
    return report


# --- checking and training ------------------------------------------------------------------------
def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16, help="batch * seq must be a multiple of 8 for FP8")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps={args.steps} must be >= 2 to see the loss move")
    return args


def check_same_output(original, converted, tokens):
    """Max |logits_converted - logits_original| in high precision; raises if beyond float32 noise."""
    with torch.no_grad():
        expected, actual = original(tokens), converted(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)  # fp32 rounding of reordered sums
    return (actual - expected).abs().max().item()


def train(model, tokens, steps, lr, recipe=None):
    """AdamW steps of next-token prediction on one batch; FP8 forward when ``recipe`` is given."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(steps):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    args = _parse_args()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = TinyGPT(args.vocab, args.hidden, args.heads, args.layers, args.seq).to(device)
    converted = copy.deepcopy(model)
    report = convert_to_te(converted, module_filter_fn=lambda module, fqn: fqn != "lm_head")
    for fqn, outcome in report.items():
        print(f"{fqn:16s} {outcome}")
    print(f"converted {sum(o.startswith('->') for o in report.values())} of {len(report)} modules")

    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    max_diff = check_same_output(model, converted, tokens[:, :-1])
    print(f"high precision: max |converted - original| = {max_diff:.3e}")

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
    losses_hp = train(model, tokens, args.steps, args.lr)
    losses_fp8 = train(converted, tokens, args.steps, args.lr, recipe)
    print("step  loss (high precision)  loss (FP8, converted)")
    for step, (hp, fp8) in enumerate(zip(losses_hp, losses_fp8)):
        print(f"{step:4d}  {hp:21.4f}  {fp8:21.4f}")
    gap = abs(losses_fp8[-1] - losses_hp[-1]) / losses_hp[-1]
    print(f"final loss gap FP8 vs high precision: {100 * gap:.2f}%")
    if not losses_fp8[-1] < losses_fp8[0] or gap > 0.1:
        sys.exit("FP8 training did not track high precision (loss must fall and end within 10%)")
    print("convert_model done")


if __name__ == "__main__":
    main()
