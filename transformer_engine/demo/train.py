"""Training loop of the demo: the same model, data and seed, once in high precision and once in FP8.

Both runs start from identical weights and see identical batches, so the gap between their loss
curves is the cost of FP8 and the ratio of their throughputs is its speed-up.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from transformer_engine.common import recipe as te_recipe

from .corpus import CharCorpus
from .model import SIZES, ModelSize, TinyGPT

__all__ = ["RECIPES", "DemoConfig", "RunResult", "run_demo", "make_recipe"]

RECIPES: Dict[str, Callable[[], object]] = {
    "delayed": lambda: te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    "current": lambda: te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID),
    "block": lambda: te_recipe.Float8BlockScaling(),
    "mxfp8": lambda: te_recipe.MXFP8BlockScaling(),
}


def make_recipe(name: str):
    """The FP8 recipe called ``name``; ValueError lists the valid names."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]()


@dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo (both runs).

    Attributes:
        size: a key of :data:`~.model.SIZES`.
        steps: optimizer steps per run.
        seed: seeds weights, data order and the corpus.
        recipe: a key of :data:`RECIPES` for the FP8 run.
        device: "cpu", "cuda" or "cuda:N".
        lr: peak AdamW learning rate (linear warm-up for 10% of the steps, cosine decay to 10%).
        eval_every: validation loss every this many steps (and at the end).
    """

    size: str = "tiny"
    steps: int = 200
    seed: int = 0
    recipe: str = "delayed"
    device: str = "cpu"
    lr: float = 3e-3
    eval_every: int = 25

    @property
    def model_size(self) -> ModelSize:
        """The :class:`ModelSize` named by ``size``."""
        return SIZES[self.size]

    @property
    def high_precision_dtype(self) -> torch.dtype:
        """BF16 on GPUs; float32 on CPUs, where bf16 arithmetic is slow and gains nothing."""
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32


@dataclass
class RunResult:
    """What one run produced."""

    label: str
    train_loss: List[float] = field(default_factory=list)
    valid_loss: List[Tuple[int, float]] = field(default_factory=list)
    tokens_per_second: float = math.nan
    peak_memory_bytes: Optional[int] = None
    seconds: float = 0.0
    interrupted: bool = False

    def as_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def _lr_at(step: int, cfg: DemoConfig) -> float:
    warm = max(1, cfg.steps // 10)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _batch(tokens: torch.Tensor, size: ModelSize, generator: torch.Generator, device) -> Tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, tokens.numel() - size.seq_len - 1, (size.batch,), generator=generator)
    rows = torch.stack([tokens[s : s + size.seq_len + 1] for s in starts.tolist()])
    rows = rows.to(device)
    return rows[:, :-1], rows[:, 1:]


def _loss(model: TinyGPT, x: torch.Tensor, y: torch.Tensor, fp8_recipe) -> torch.Tensor:
    logits = model(x, fp8_recipe)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def _validate(model: TinyGPT, batches, fp8_recipe) -> float:
    model.eval()
    total = sum(_loss(model, x, y, fp8_recipe).item() for x, y in batches)
    model.train()
    return total / len(batches)


def _train_one(label: str, model: TinyGPT, corpus: CharCorpus, cfg: DemoConfig, fp8_recipe, on_step) -> RunResult:
    device = torch.device(cfg.device)
    size = cfg.model_size
    result = RunResult(label)
    train_tokens = torch.tensor(corpus.train, dtype=torch.long)
    valid_tokens = torch.tensor(corpus.valid, dtype=torch.long)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    valid_gen = torch.Generator().manual_seed(cfg.seed + 1)
    valid_batches = [_batch(valid_tokens, size, valid_gen, device) for _ in range(4)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed_tokens, timed_seconds, start = 0, 0.0, time.perf_counter()
    try:
        for step in range(cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, cfg)
            x, y = _batch(train_tokens, size, data_gen, device)
            t0 = time.perf_counter()
            loss = _loss(model, x, y, fp8_recipe)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            result.train_loss.append(loss.item())  # .item() synchronises the device
            if step >= min(3, cfg.steps // 5):  # the first steps compile kernels and fill caches
                timed_seconds += time.perf_counter() - t0
                timed_tokens += x.numel()
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                result.valid_loss.append((step + 1, _validate(model, valid_batches, fp8_recipe)))
            on_step(label, step, result)
    except KeyboardInterrupt:
        result.interrupted = True
    result.seconds = time.perf_counter() - start
    result.tokens_per_second = timed_tokens / timed_seconds if timed_seconds > 0 else math.nan
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    return result


def run_demo(cfg: DemoConfig, on_step: Callable = lambda label, step, result: None) -> List[RunResult]:
    """Train the high-precision run, then the FP8 run, from the same initial weights.

    Stops early (returning what was done, ``interrupted`` set) on Ctrl-C.
    """
    fp8_recipe = make_recipe(cfg.recipe)
    corpus = CharCorpus.build(train_chars=400_000, valid_chars=40_000, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    dtype = cfg.high_precision_dtype
    base = TinyGPT(corpus.vocab_size, cfg.model_size, dtype, torch.device(cfg.device))
    initial = copy.deepcopy(base.state_dict())
    hp_label = "bf16" if dtype == torch.bfloat16 else "fp32"
    results = [_train_one(hp_label, base, corpus, cfg, None, on_step)]
    if results[0].interrupted:
        return results
    fp8_model = TinyGPT(corpus.vocab_size, cfg.model_size, dtype, torch.device(cfg.device))
    fp8_model.load_state_dict(initial)
    torch.manual_seed(cfg.seed)
    results.append(_train_one(f"fp8-{cfg.recipe}", fp8_model, corpus, cfg, fp8_recipe, on_step))
    return results
