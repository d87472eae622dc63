"""Training loop of the demo: the same model, data and seed, once in high precision and once in FP8.

Both runs start from identical weights and see identical batches, so the gap between their loss
curves is the cost of FP8 and the ratio of their median step times is its speed-up. Further
high-precision runs with other seeds (other initial weights and batch order, the same corpus and
validation batches) measure the seed-to-seed spread of the final validation loss: the yardstick a
reader needs to judge whether FP8's gap matters.

Speed: every step (forward, backward, clipping, optimizer, loss read back, which synchronises the
device) is timed; the first ``warmup_steps`` steps (kernel compilation, caches) are left out and the
rest summarised by their median and interquartile range. Validation is never timed.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from transformer_engine.common import recipe as te_recipe

from .corpus import CharCorpus
from .model import SIZES, ModelSize, TinyGPT

__all__ = ["RECIPES", "DemoConfig", "RunResult", "run_demo", "make_recipe", "unavailable_recipes"]

RECIPES: Dict[str, Callable[[], object]] = {
    "delayed": lambda: te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    "current": lambda: te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID),
    "block": lambda: te_recipe.Float8BlockScaling(),
    "mxfp8": lambda: te_recipe.MXFP8BlockScaling(),
    "nvfp4": lambda: te_recipe.NVFP4BlockScaling(),
}


def make_recipe(name: str):
    """The FP8 recipe called ``name``; ValueError lists the valid names."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]()


def unavailable_recipes() -> Dict[str, str]:
    """Recipes of :data:`RECIPES` that TE-FL's PyTorch modules cannot run at all, each with the reason.

    Whether an implemented recipe runs on a given GPU is a separate question, answered when the demo
    starts (``te-fl info`` lists both).
    """
    from transformer_engine.pytorch.quantization.recipe_state import check_recipe_implemented

    reasons = {}
    for name in RECIPES:
        try:
            check_recipe_implemented(make_recipe(name))
        except NotImplementedError as exc:
            reasons[name] = str(exc).split(";")[0]
    return reasons


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
        hp_seeds: high-precision runs, with seeds ``seed``, ``seed + 1``, ...; two or more give the
            seed-to-seed spread of the validation loss.
        warmup_steps: steps left out of the speed statistics (at most half of ``steps``).
    """

    size: str = "tiny"
    steps: int = 200
    seed: int = 0
    recipe: str = "delayed"
    device: str = "cpu"
    lr: float = 3e-3
    eval_every: int = 25
    hp_seeds: int = 2
    warmup_steps: int = 5

    def __post_init__(self):
        if self.hp_seeds < 1:
            raise ValueError(f"hp_seeds must be >= 1 (the high-precision baseline), got {self.hp_seeds}")

    @property
    def timed_from(self) -> int:
        """Index of the first timed step: ``warmup_steps``, at most half of the steps."""
        return min(self.warmup_steps, self.steps // 2)

    @property
    def model_size(self) -> ModelSize:
        """The :class:`ModelSize` named by ``size``."""
        return SIZES[self.size]

    @property
    def high_precision_dtype(self) -> torch.dtype:
        """BF16 on GPUs; float32 on CPUs, where bf16 arithmetic is slow and gains nothing."""
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32


def _quartiles(values: List[float]) -> Tuple[float, float, float]:
    """(q1, median, q3) of ``values`` (linear interpolation); NaNs when empty."""
    if not values:
        return math.nan, math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


@dataclass
class RunResult:
    """What one run produced.

    Attributes:
        label: the run's name in the table ("fp32", "fp8-delayed", "fp32 seed 1", ...).
        seed: seed of the initial weights and the batch order.
        precision: "high" or "fp8".
        train_loss: training loss of every step.
        valid_loss: (step, validation loss) pairs.
        step_seconds: wall time of every step, warm-up included.
        warmup_steps: how many leading entries of ``step_seconds`` the speed statistics leave out.
        tokens_per_step: batch x sequence length.
        tokens_per_second: tokens_per_step / median timed step time.
        step_seconds_median, step_seconds_q1, step_seconds_q3: the timed steps' quartiles.
        peak_memory_bytes: peak CUDA memory (None on CPU).
        seconds: wall time of the whole run, validation included.
        interrupted: Ctrl-C stopped the run.
    """

    label: str
    seed: int = 0
    precision: str = "high"
    train_loss: List[float] = field(default_factory=list)
    valid_loss: List[Tuple[int, float]] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)
    warmup_steps: int = 0
    tokens_per_step: int = 0
    tokens_per_second: float = math.nan
    step_seconds_median: float = math.nan
    step_seconds_q1: float = math.nan
    step_seconds_q3: float = math.nan
    peak_memory_bytes: Optional[int] = None
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def final_valid_loss(self) -> Optional[float]:
        """The last validation loss, None before the first evaluation."""
        return self.valid_loss[-1][1] if self.valid_loss else None

    def summarise_speed(self) -> None:
        """Fill the quartiles and tokens/s from the step times after warm-up."""
        q1, median, q3 = _quartiles(self.step_seconds[self.warmup_steps :])
        self.step_seconds_q1, self.step_seconds_median, self.step_seconds_q3 = q1, median, q3
        self.tokens_per_second = self.tokens_per_step / median if median > 0 else math.nan

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


def _train_one(result: RunResult, model: TinyGPT, corpus: CharCorpus, cfg: DemoConfig, fp8_recipe, on_step) -> RunResult:
    """Train ``model`` for ``cfg.steps`` steps with batches drawn from ``result.seed``; fills ``result``."""
    device = torch.device(cfg.device)
    size = cfg.model_size
    train_tokens = torch.tensor(corpus.train, dtype=torch.long)
    valid_tokens = torch.tensor(corpus.valid, dtype=torch.long)
    data_gen = torch.Generator().manual_seed(result.seed)
    valid_gen = torch.Generator().manual_seed(cfg.seed + 1)  # every run validates on the same batches
    valid_batches = [_batch(valid_tokens, size, valid_gen, device) for _ in range(4)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    result.warmup_steps, result.tokens_per_step = cfg.timed_from, size.batch * size.seq_len
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
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
            result.step_seconds.append(time.perf_counter() - t0)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                result.valid_loss.append((step + 1, _validate(model, valid_batches, fp8_recipe)))
            on_step(result.label, step, result)
    except KeyboardInterrupt:
        result.interrupted = True
    result.seconds = time.perf_counter() - start
    result.warmup_steps = min(result.warmup_steps, len(result.step_seconds) // 2)  # a run stopped early times half
    result.summarise_speed()
    if device.type == "cuda":
        result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    return result


def _model(corpus: CharCorpus, cfg: DemoConfig, seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(corpus.vocab_size, cfg.model_size, cfg.high_precision_dtype, torch.device(cfg.device))


def run_demo(cfg: DemoConfig, on_step: Callable = lambda label, step, result: None) -> List[RunResult]:
    """Train the high-precision run, the FP8 run from the same initial weights, then the other seeds.

    Returns the runs in that order: high precision (seed ``cfg.seed``), FP8 (same seed), then
    high precision with seeds ``cfg.seed + 1`` ... ``cfg.seed + cfg.hp_seeds - 1``. Stops early
    (returning what was done, the last run's ``interrupted`` set) on Ctrl-C.
    """
    fp8_recipe = make_recipe(cfg.recipe)
    corpus = CharCorpus.build(train_chars=400_000, valid_chars=40_000, seed=cfg.seed)
    hp_label = "bf16" if cfg.high_precision_dtype == torch.bfloat16 else "fp32"
    base = _model(corpus, cfg, cfg.seed)
    initial = copy.deepcopy(base.state_dict())
    results = [_train_one(RunResult(hp_label, cfg.seed), base, corpus, cfg, None, on_step)]
    if results[-1].interrupted:
        return results
    fp8_model = _model(corpus, cfg, cfg.seed)
    fp8_model.load_state_dict(initial)
    results.append(_train_one(RunResult(f"fp8-{cfg.recipe}", cfg.seed, "fp8"), fp8_model, corpus, cfg, fp8_recipe, on_step))
    for seed in range(cfg.seed + 1, cfg.seed + cfg.hp_seeds):
        if results[-1].interrupted:
            break
        result = RunResult(f"{hp_label} seed {seed}", seed)
        results.append(_train_one(result, _model(corpus, cfg, seed), corpus, cfg, None, on_step))
    return results
