"""Module machinery: checkpoints (_extra_state in TE's format, read without running code; bit-identical continuation), their errors, recipe
changes between forwards, device default."""

import copy
import io
import pickle
import warnings

import pytest
import torch

import transformer_engine.pytorch as te
from tests.utils import randn
from transformer_engine.common.recipe import CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, \
    NVFP4BlockScaling
from transformer_engine.pytorch.tensor import DType, Float8CurrentScalingQuantizer
from transformer_engine.pytorch.module.base import first_microbatch

RECIPE = DelayedScaling(margin=1, fp8_format=Format.HYBRID, amax_history_len=5, amax_compute_algo="max")


def _model():
    return torch.nn.Sequential(
        te.LayerNormLinear(32, 32, normalization="RMSNorm"),
        te.LayerNormMLP(32, 64, activation="swiglu"),
        te.Linear(32, 16),
    )


def _train(model, optimizer, batches, recipe):
    losses = []
    for x, target in batches:
        with te.autocast(recipe=recipe):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _batches(n):
    return [(randn(16, 32), randn(16, 16)) for _ in range(n)]


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_checkpoint_round_trip_continues_bit_identically():
    batches = _batches(6)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, batches[:3], RECIPE)
    saved = _round_trip({"model": model.state_dict(), "opt": opt.state_dict()})
    straight = _train(model, opt, batches[3:], RECIPE)

    torch.manual_seed(1234)  # a different initialization, overwritten by the checkpoint
    resumed_model = _model()
    resumed_opt = torch.optim.Adam(resumed_model.parameters(), lr=1e-3)
    resumed_model.load_state_dict(saved["model"], strict=True)
    resumed_opt.load_state_dict(saved["opt"])
    meta = resumed_model[1].fp8_meta
    assert meta["recipe"] == RECIPE and meta["scaling_fwd"].amax_history.shape == (5, 6)
    resumed = _train(resumed_model, resumed_opt, batches[3:], RECIPE)

    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    for a, b in zip(model, resumed_model):
        for key in ("scaling_fwd", "scaling_bwd"):
            for attr in ("scale", "scale_inv", "amax_history"):
                assert torch.equal(getattr(a.fp8_meta[key], attr), getattr(b.fp8_meta[key], attr))


def test_extra_state_is_empty_without_delayed_scaling():
    layer = te.Linear(16, 16)
    assert layer.get_extra_state().numel() == 0
    with te.autocast(recipe=Float8CurrentScaling()):
        layer(randn(8, 16))
    state = layer.state_dict()["_extra_state"]
    assert state.dtype == torch.uint8 and state.numel() == 0
    te.Linear(16, 16).load_state_dict(_round_trip(layer.state_dict()))


def test_callable_recipe_fields_are_stored_by_name():
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(0))
    layer = te.Linear(16, 16)
    with te.autocast(recipe=recipe):
        layer(randn(8, 16))
    fresh = te.Linear(16, 16)
    fresh.load_state_dict(_round_trip(layer.state_dict()))
    assert fresh.fp8_meta["recipe"].amax_compute_algo == "max"  # the default; autocast brings the callable back
    assert torch.equal(fresh.fp8_meta["scaling_fwd"].amax_history, layer.fp8_meta["scaling_fwd"].amax_history)


def _delayed_checkpoint():
    layer = te.Linear(16, 16)
    with te.autocast(recipe=RECIPE):
        layer(randn(8, 16))
    return layer.state_dict()


def test_loading_a_checkpoint_of_another_recipe_raises():
    state = _delayed_checkpoint()
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        built_for_current = te.Linear(16, 16)
    with pytest.raises(ValueError, match="DelayedScaling checkpoint into Linear, which uses Float8CurrentScaling"):
        built_for_current.load_state_dict(state)
    ran_current = te.Linear(16, 16)
    with te.autocast(recipe=Float8CurrentScaling()):
        ran_current(randn(8, 16))
    with pytest.raises(ValueError, match="same recipe"):
        ran_current.load_state_dict(state)


_RAN = []


def _side_effect(text):
    _RAN.append(text)


class _Payload:
    """A pickle that runs code when loaded unrestricted (``_side_effect``)."""

    def __reduce__(self):
        return _side_effect, ("ran",)


def _as_bytes_tensor(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def test_foreign_or_mismatched_extra_state_raises():
    layer = te.Linear(16, 16)
    with pytest.raises(ValueError, match="no delayed-scaling state"):
        layer.set_extra_state(_as_bytes_tensor({"scale_fwd": 1}))
    with pytest.raises(ValueError, match="_side_effect.*can run code"):
        layer.set_extra_state(_as_bytes_tensor({"recipe": _Payload()}))
    assert not _RAN  # refused before anything was built
    with pytest.raises(ValueError, match="1 GEMMs but LayerNormMLP has 2"):
        te.LayerNormMLP(16, 16).set_extra_state(_delayed_checkpoint()["_extra_state"])
    state = {k: v for k, v in layer.state_dict().items() if k != "_extra_state"}
    with pytest.raises(RuntimeError, match="_extra_state"):
        te.Linear(16, 16).load_state_dict(state, strict=True)


def test_recipe_type_change_casts_with_the_new_quantizers():
    """The per-GEMM quantizers are rebuilt with the states: after a switch to current scaling the output
    equals a fresh layer's, and the old delayed-scaling state records nothing."""
    layer = te.Linear(32, 16)
    fresh = copy.deepcopy(layer)
    x = randn(16, 32)
    with te.autocast(recipe=RECIPE):
        layer(x)
    old_state = layer.fp8_meta["scaling_fwd"]
    old_history = old_state.amax_history.clone()
    with pytest.warns(UserWarning, match="Recipe type changed"), te.autocast(recipe=Float8CurrentScaling()):
        out = layer(x * 3)
    with te.autocast(recipe=Float8CurrentScaling()):
        expected = fresh(x * 3)
    assert torch.equal(out, expected)
    assert torch.equal(old_state.amax_history, old_history)


@pytest.mark.parametrize("first, second", [
    (Float8BlockScaling(), Float8BlockScaling(w_block_scaling_dim=1)),
    (NVFP4BlockScaling(), NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True)),
    (CustomRecipe(qfactory=lambda role: Float8CurrentScalingQuantizer(DType.kFloat8E4M3)),
     CustomRecipe(qfactory=lambda role: Float8CurrentScalingQuantizer(DType.kFloat8E5M2))),
], ids=["block", "nvfp4", "custom"])
def test_same_recipe_type_with_other_rules_casts_with_the_new_quantizers(first, second):
    """A recipe of the same type but other fields (tiles, QParams, a CustomRecipe's factory): the module's casts follow
    the new recipe (its quantizers are rebuilt, without a warning), as a fresh module's do, forward and backward.
    The weight's rows span 2^0 .. 2^4, so per-row and per-tile scales differ."""
    layer = te.Linear(32, 32)
    with torch.no_grad():
        layer.weight.mul_(2.0 ** (torch.arange(32) % 5).unsqueeze(1))
    fresh = copy.deepcopy(layer)
    x = randn(32, 32)
    with te.autocast(recipe=first):
        layer(x)

    def step(module):
        torch.manual_seed(0)
        x_grad = (x * 3).requires_grad_()
        with te.autocast(recipe=second):
            out = module(x_grad)
        out.square().sum().backward()
        return out, x_grad.grad, module.weight.grad

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(layer)
    for actual, expected in zip(got, step(fresh)):
        assert torch.equal(actual, expected)


def test_same_recipe_type_in_another_format_casts_gradients_in_it():
    layer = te.Linear(16, 16)
    for fmt, grad_dtype, fp8_max in ((Format.HYBRID, torch.float8_e5m2, 57344.0), (Format.E4M3, torch.float8_e4m3fn, 448.0)):
        with te.autocast(recipe=DelayedScaling(fp8_format=fmt, amax_history_len=1)):
            y = layer(randn(16, 16))
        y.sum().backward()  # dy = 1: amax 1, scale = fp8_max
        assert layer.quantizers["scaling_bwd"][0].dtype == DType.cast(grad_dtype)  # TE's public quantizer follows the state
        assert layer.fp8_meta["scaling_bwd"].scale[0] == fp8_max


def test_the_fp8_weight_copy_records_no_autograd_graph():
    layer = te.Linear(16, 16)
    with te.autocast(recipe=RECIPE):
        layer(randn(16, 16), is_first_microbatch=True)  # keeps the FP8 weight in the cache
    cached = layer._weight_cache["weight"]
    assert cached.data_t is not None  # grad mode on: W^T for dgrad comes along
    assert not cached.data.requires_grad and not cached.data_t.requires_grad


def test_first_microbatch_is_the_default_of_modules_called_without_one():
    """Inside first_microbatch(True) a call casts and caches the FP8 weight, inside first_microbatch(False) it reads the
    cache (a weight changed since is not seen), outside it casts afresh; an explicit argument wins."""
    layer, x = te.Linear(16, 16), randn(16, 16)
    with te.autocast(recipe=RECIPE):
        with first_microbatch(value=True):
            cast = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2.0)
        with first_microbatch(value=False):
            cached = layer(x)
            explicit = layer(x, is_first_microbatch=True)  # casts the doubled weight, and caches it
        fresh = layer(x)
    torch.testing.assert_close(cached, cast, rtol=0, atol=0)
    assert not torch.equal(explicit, cast) and not torch.equal(fresh, cast)
    torch.testing.assert_close(fresh, explicit, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only default")
def test_default_device_is_cpu_without_cuda():
    assert te.Linear(8, 8).weight.device.type == "cpu"
    assert te.LayerNormMLP(8, 8).fc1_weight.device.type == "cpu"


@pytest.mark.parametrize("recipe", [None, RECIPE, Float8CurrentScaling()], ids=["hp", "delayed", "current"])
def test_zero_token_batches(recipe):
    for module in (te.Linear(32, 16), te.LayerNormLinear(32, 16), te.LayerNormMLP(32, 64)):
        x = torch.zeros(0, 32, requires_grad=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = module(x)
        out.sum().backward()
        assert out.shape[0] == 0 and x.grad.shape == (0, 32)
        assert all(p.grad is not None and torch.all(p.grad == 0) for p in module.parameters())


@pytest.mark.parametrize("recipe", [RECIPE, Float8CurrentScaling(), Float8BlockScaling()], ids=["delayed", "current", "block"])
def test_inference_casts_no_transposed_copies(monkeypatch, recipe):
    """Under torch.no_grad the FP8 forward writes no x^T / W^T (nothing will run backward); with grad it does."""
    from transformer_engine.plugin import ops

    calls = []
    for name in ("cast_transpose", "fp8_transpose", "cast_transpose_blockwise"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *args, _real=real, _name=name, **kwargs: calls.append(_name) or _real(*args, **kwargs))
    model, x = _model(), randn(8, 32)
    with torch.no_grad(), te.autocast(recipe=recipe):
        inference = model(x)
    assert calls == []
    with te.autocast(recipe=recipe):
        training = model(x)
    assert calls  # the transposes backward reads
    torch.testing.assert_close(inference, training.detach(), rtol=0, atol=0)


def _te_state(recipe, n_fwd, n_bwd, num_gemms, generator):
    """What NVIDIA TE 2.x's ``get_extra_state`` pickles for a delayed-scaling module."""
    length = recipe.amax_history_len
    rand = lambda *shape: torch.rand(*shape, generator=generator) + 0.5  # noqa: E731
    return {"recipe": recipe, "scale_fwd": rand(n_fwd), "amax_history_fwd": rand(length, n_fwd), "scale_bwd": rand(n_bwd),
            "amax_history_bwd": rand(length, n_bwd), "extra_fp8_variables": {"num_gemms": num_gemms, "fp8_checkpoint": True}}


def test_extra_state_is_te_s_checkpoint_format_both_ways():
    """Ours unpickles (plainly, as TE and Megatron-Core read it) to TE's keys and layout; TE's loads into our module
    (scale_inv = 1 / scale), and saving it again gives the same tensors."""
    layer = _model()[1]  # LayerNormMLP: two GEMMs, slots GEMM-major as TE's
    with te.autocast(recipe=RECIPE):
        layer(randn(16, 32))
    ours = pickle.loads(layer.get_extra_state().numpy().tobytes())
    assert ours["recipe"] == RECIPE and ours["extra_fp8_variables"]["num_gemms"] == 2
    meta = layer.fp8_meta
    assert torch.equal(ours["scale_fwd"], meta["scaling_fwd"].scale) and torch.equal(ours["amax_history_bwd"],
                                                                                     meta["scaling_bwd"].amax_history)

    theirs = _te_state(RECIPE, 6, 4, 2, torch.Generator().manual_seed(0))
    fresh = te.LayerNormMLP(32, 64, activation="swiglu")
    fresh.load_state_dict({**{k: v for k, v in layer.state_dict().items() if k != "_extra_state"},
                           "_extra_state": _as_bytes_tensor(theirs)})
    state = fresh.fp8_meta["scaling_fwd"]
    assert torch.equal(state.scale, theirs["scale_fwd"]) and torch.equal(state.amax_history, theirs["amax_history_fwd"])
    assert torch.equal(state.scale_inv, 1 / theirs["scale_fwd"])
    again = pickle.loads(fresh.get_extra_state().numpy().tobytes())
    assert all(torch.equal(again[key], theirs[key]) for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"))
    assert _round_trip(fresh.state_dict())["_extra_state"].dtype == torch.uint8  # torch.load(weights_only=True) reads it


def test_grouped_linear_state_splits_per_expert_as_megatron_core_does():
    """TE's GroupedLinear stores its slots role-major; Megatron-Core's distributed checkpoint splits the state per
    expert with ``view(3, -1)[:, g]`` and merges it back with ``cat``: expert g gets its own input / weight / output
    slots, and the merged state loads back unchanged."""
    n = 3
    layer = te.GroupedLinear(n, 32, 32)
    with te.autocast(recipe=RECIPE):
        layer(randn(24, 32), [8, 8, 8])
    meta = layer.fp8_meta
    with torch.no_grad():  # distinct values per slot, so that a permuted slot would show
        meta["scaling_fwd"].scale.copy_(torch.arange(1.0, 3 * n + 1))
        meta["scaling_bwd"].scale.copy_(torch.arange(1.0, 2 * n + 1))
    state = pickle.loads(layer.get_extra_state().numpy().tobytes())
    length = RECIPE.amax_history_len
    for g in range(n):  # Megatron's _split_extra_state
        scale_fwd, scale_bwd = state["scale_fwd"].view(3, -1)[:, g], state["scale_bwd"].view(2, -1)[:, g]
        history_fwd = state["amax_history_fwd"].view(length, 3, -1)[:, :, g]
        assert torch.equal(scale_fwd, meta["scaling_fwd"].scale[3 * g:3 * g + 3])
        assert torch.equal(scale_bwd, meta["scaling_bwd"].scale[2 * g:2 * g + 2])
        assert torch.equal(history_fwd, meta["scaling_fwd"].amax_history[:, 3 * g:3 * g + 3])
    merged = dict(state)  # Megatron's merge_extra_states of the per-expert parts
    merged["scale_fwd"] = torch.cat([state["scale_fwd"].view(3, -1)[:, g].view(-1, 1) for g in range(n)], dim=1).view(-1)
    fresh = te.GroupedLinear(n, 32, 32)
    fresh.set_extra_state(_as_bytes_tensor(merged))
    assert torch.equal(fresh.fp8_meta["scaling_fwd"].scale, meta["scaling_fwd"].scale)
    assert torch.equal(fresh.fp8_meta["scaling_bwd"].amax_history, meta["scaling_bwd"].amax_history)


def test_first_format_checkpoints_still_load():
    """This package's JSON payload (before 2026-11-27): one GEMM, history length 2."""
    import base64
    import json

    def b64(values):
        return base64.b64encode(torch.tensor(values, dtype=torch.float32).numpy().tobytes()).decode("ascii")

    fields = {"margin": 0, "fp8_format": {"format": "HYBRID"}, "amax_history_len": 2, "amax_compute_algo": "max"}
    payload = {"format": "transformer_engine_fl.extra_state", "version": 1, "num_gemms": 1,
               "recipe": {"class": "DelayedScaling", "fields": fields},
               "scaling_fwd": {"shape": [2, 3], "scale": b64([1, 2, 4]), "scale_inv": b64([1, 0.5, 0.25]), "amax_history": b64([1] * 6)},
               "scaling_bwd": {"shape": [2, 2], "scale": b64([8, 16]), "scale_inv": b64([0.125, 0.0625]), "amax_history": b64([2] * 4)}}
    layer = te.Linear(16, 16)
    layer.set_extra_state(torch.frombuffer(bytearray(json.dumps(payload).encode()), dtype=torch.uint8))
    assert layer.fp8_meta["scaling_fwd"].scale.tolist() == [1, 2, 4] and layer.fp8_meta["scaling_bwd"].scale_inv.tolist() == [0.125, 0.0625]
