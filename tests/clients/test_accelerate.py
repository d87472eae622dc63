"""HF Accelerate (with transformers) as a client: ``Accelerator(mixed_precision="fp8")`` with its Transformer
Engine backend, as its users run it (default settings).

``Accelerator.prepare`` swaps the model's ``nn.Linear`` layers for ours (``convert_model``), wraps its
forward in ``torch.autocast`` (bf16) and ``te.fp8_autocast`` with the default ``DelayedScaling``, and, with
``dynamo_backend``, compiles the prepared model with ``torch.compile``. The model is a tiny
``LlamaForCausalLM`` trained by AdamW on a fixed batch (it memorizes it); on the CPU the same code path
runs with FP8 emulated by the reference backend. ``aot_eager`` stands for the compiler: it traces forward
and backward as Inductor would, at a fraction of the compile time on a CPU.
"""

import functools
from typing import NamedTuple, Sequence

import pytest
import torch

import transformer_engine.pytorch as te

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, LAYERS = 128, 2, 32, 2

#: E4M3 / E5M2 largest finite values: DelayedScaling's scale = fp8_max / max(amax history), margin 0
_FP8_MAX_FWD, _FP8_MAX_BWD = 448.0, 57344.0

#: |FP8 loss - bf16 loss| per step, 6 steps from seed 0: measured at most 0.0042 (0.0075 over seeds 0-5),
#: against a loss drop of ~0.75 over the 6 steps. E4M3 keeps 3 mantissa bits (relative rounding up to
#: 2^-4 per element). FP8 gradients in E4M3 rather than E5M2 (``fp8_format="E4M3"``) move the losses
#: by up to 0.047-0.062 (seeds 0-5), which this bound catches.
_FP8_LOSS_ATOL = 0.02


class _Run(NamedTuple):
    losses: torch.Tensor  # float32 [steps]
    model: torch.nn.Module  # unwrapped: the swapped LlamaForCausalLM
    linears: int  # nn.Linear layers in the model before prepare


def _reset_accelerate() -> None:
    """Accelerate keeps its state in process-wide singletons; each run starts from a clean one."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate():
    _reset_accelerate()
    yield
    _reset_accelerate()


def _fp8_handlers() -> list:
    """Accelerate's TE recipe handler at its defaults (``TERecipeKwargs``; ``FP8RecipeKwargs`` in older releases)."""
    if hasattr(accelerate.utils, "TERecipeKwargs"):
        return [accelerate.utils.TERecipeKwargs()]
    return [accelerate.utils.FP8RecipeKwargs(backend="TE")]


def _train(mixed_precision: str, lengths: Sequence[int], layers: int = LAYERS, dynamo_backend: str = "no") -> _Run:
    """AdamW steps of a tiny Llama prepared by Accelerate (seed 0); step i trains on the first ``lengths[i]``
    tokens of one fixed batch, which the model memorizes."""
    _reset_accelerate()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    tokens = torch.randint(0, VOCAB, (BATCH, max(lengths)))  # drawn before prepare, which draws for our weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accelerator = accelerate.Accelerator(mixed_precision=mixed_precision, dynamo_backend=dynamo_backend,
                                         kwargs_handlers=_fp8_handlers() if mixed_precision == "fp8" else None)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for ids in (tokens[:, :n] for n in lengths):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float())
    return _Run(losses=torch.stack(losses), model=accelerator.unwrap_model(model), linears=linears)


def _te_linears(model: torch.nn.Module) -> list:
    """Our Linear layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, te.Linear)]


def test_fp8_swaps_linears_trains_and_tracks_bf16():
    """Accelerate's FP8 defaults: every nn.Linear becomes ours, the delayed-scaling state advances, and the
    losses fall and stay within ``_FP8_LOSS_ATOL`` of the bf16 run's from the same seed."""
    fp8 = _train(mixed_precision="fp8", lengths=[SEQ] * 6)
    bf16 = _train(mixed_precision="bf16", lengths=[SEQ] * 6)
    linears = _te_linears(fp8.model)
    assert fp8.linears == LAYERS * 7 + 1 and len(linears) == fp8.linears  # q, k, v, o, gate, up, down per layer; lm_head
    assert not any(type(m) is torch.nn.Linear for m in fp8.model.modules())
    assert torch.isfinite(fp8.losses).all() and (fp8.losses.diff() < 0).all()
    torch.testing.assert_close(fp8.losses, bf16.losses, atol=_FP8_LOSS_ATOL, rtol=0)
    for linear in linears:
        fwd, bwd = linear.fp8_meta["scaling_fwd"], linear.fp8_meta["scaling_bwd"]
        assert linear.fp8_meta["recipe"].amax_history_len == 1024  # DelayedScaling's default: no step fell off the history
        # input (0) and weight (1) of the forward GEMM, grad output (0) of the backward ones: cast every step
        for state, slots, fp8_max in ((fwd, [0, 1], _FP8_MAX_FWD), (bwd, [0], _FP8_MAX_BWD)):
            amax = state.amax_history[:, slots].amax(dim=0)
            assert (amax > 0).all() and (state.scale[slots] != 1).all()
            torch.testing.assert_close(state.scale[slots], fp8_max / amax)


# The compiled tests share one pair of runs (eager, aot_eager) over these lengths: 3 steps of one length, then
# two others, as a data loader's batches vary. One layer: compile time grows with the layers traced.
_LENGTHS = (SEQ, SEQ, SEQ, 24, 40)


@functools.cache
def _eager_and_compiled():
    """(eager run, aot_eager run, graph breaks counted while compiling) over ``_LENGTHS``."""
    from torch._dynamo.utils import counters

    eager = _train(mixed_precision="fp8", lengths=_LENGTHS, layers=1)
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = _train(mixed_precision="fp8", lengths=_LENGTHS, layers=1, dynamo_backend="aot_eager")
        breaks = sum(counters["graph_break"].values())
    finally:
        torch._dynamo.reset()
    return eager, compiled, breaks


@pytest.fixture(scope="module", autouse=True)
def _drop_shared_runs():
    yield
    _eager_and_compiled.cache_clear()


@pytest.mark.slow
def test_dynamo_backend_matches_eager_without_graph_breaks():
    """``dynamo_backend="aot_eager"``: bit-identical losses over 3 steps of one length, and no graph break.

    Today nothing in Accelerate's FP8 wrapper, transformers' Llama or our modules breaks the graph, so the
    count is 0 overall; should a transformers release break in its own code, count the breaks whose user
    stack is in transformer_engine (``torch._dynamo.explain``) instead. One recompile at the second step is
    expected (the first traced step builds the FP8 states), so the graphs are not asserted on."""
    eager, compiled, breaks = _eager_and_compiled()
    assert torch.equal(compiled.losses[:3], eager.losses[:3])
    assert breaks == 0


@pytest.mark.slow
def test_dynamo_backend_with_changing_sequence_length_matches_eager():
    """Batches of other lengths compile (a recompile with a dynamic sequence length) and still give the eager
    losses bit for bit; the FP8 states of every layer end as eager's."""
    eager, compiled, _ = _eager_and_compiled()
    assert torch.equal(compiled.losses, eager.losses)
    for ours, reference in zip(_te_linears(compiled.model), _te_linears(eager.model), strict=True):
        for key in ("scaling_fwd", "scaling_bwd"):
            assert torch.equal(ours.fp8_meta[key].scale, reference.fp8_meta[key].scale)
            assert torch.equal(ours.fp8_meta[key].amax_history, reference.fp8_meta[key].amax_history)
