"""The demo's model: a character-level GPT whose blocks are ``te.TransformerLayer``.

Embedding -> N x TransformerLayer (causal, pre-LayerNorm, GELU MLP) -> LayerNorm -> vocabulary
projection. The vocabulary is padded to a multiple of 16 so every GEMM meets FP8's shape rule; the
padded logits are never targets. The embedding and the final projection stay in high precision,
as in TE's recipes; everything inside the blocks runs in FP8 under ``te.autocast``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch
from torch import nn

import transformer_engine.pytorch as te

__all__ = ["ModelSize", "SIZES", "TinyGPT"]


@dataclass(frozen=True)
class ModelSize:
    """Shape of the demo model and of one training batch."""

    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch: int

    @property
    def ffn_hidden(self) -> int:
        """The MLP's inner width, 4 x hidden as in GPT-2."""
        return 4 * self.hidden


SIZES: Dict[str, ModelSize] = {
    "tiny": ModelSize(hidden=64, layers=2, heads=4, seq_len=64, batch=16),  # CPU default: ~1 min per run
    "small": ModelSize(hidden=256, layers=4, heads=8, seq_len=128, batch=32),
    "medium": ModelSize(hidden=1024, layers=8, heads=16, seq_len=512, batch=16),
    "large": ModelSize(hidden=4096, layers=4, heads=32, seq_len=2048, batch=4),  # GPU default; PERF.md's layer size
}


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class TinyGPT(nn.Module):
    """Character-level GPT built from ``te.TransformerLayer``.

    Args:
        vocab_size: number of tokens.
        size: the :class:`ModelSize`.
        dtype: parameter and activation dtype.
        device: where the parameters live.
    """

    def __init__(self, vocab_size: int, size: ModelSize, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.vocab_size = vocab_size
        padded_vocab = _round_up(vocab_size, 16)
        self.embed = nn.Embedding(padded_vocab, size.hidden, device=device, dtype=dtype)
        self.pos = nn.Embedding(size.seq_len, size.hidden, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(
            te.TransformerLayer(
                size.hidden,
                size.ffn_hidden,
                size.heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",
                attn_input_format="bshd",
                params_dtype=dtype,
                device=device,
            )
            for _ in range(size.layers)
        )
        self.final_norm = te.LayerNorm(size.hidden, dtype=dtype, device=device)
        self.head = nn.Linear(size.hidden, padded_vocab, bias=False, device=device, dtype=dtype)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, fp8_recipe=None) -> torch.Tensor:
        """Logits [batch, seq, vocab] (padding columns removed) for int64 ``tokens`` [batch, seq].

        With ``fp8_recipe`` the blocks run under ``te.autocast(recipe=fp8_recipe)``.
        """
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.pos(positions)
        with te.autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe):
            for block in self.blocks:
                h = block(h)
        logits = self.head(self.final_norm(h))
        return logits[..., : self.vocab_size]
