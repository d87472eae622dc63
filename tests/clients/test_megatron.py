"""Megatron-Core (megatron-core from PyPI, unchanged) as a client: its GPT built from the Transformer Engine
layer spec runs on our package.

On the CPU with gloo ranks (and on GPUs with nccl ranks, ``gpu`` tests): the TE-spec GPT computes the loss of the same GPT built from
Megatron's local
(non-TE) spec holding the same weights, trains alongside it, trains under FP8 (emulated), and at tensor
parallelism 2 computes what it computes on one rank. (Megatron's local core attention allocates its
buffers on CUDA, so on the CPU the local spec takes the TE core attention: the comparison covers the linear
and norm layers, Megatron's own against ours; on a GPU it covers the attention too.)
"""

import importlib
import importlib.util
import re
import warnings

import pytest
import torch

from tests.pytorch.parallel._ranks import close_pools, device, get_pool

if importlib.util.find_spec("megatron") is None:  # not installed (CI installs it); an import that fails is a failure
    pytest.skip("megatron-core is not installed", allow_module_level=True)

VOCAB, SEQ, BATCH, HIDDEN, HEADS = 128, 16, 2, 64, 4


@pytest.fixture(scope="module", autouse=True)
def _stop_pools():
    yield
    close_pools()


def test_import_megatron_core_with_te():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("megatron.core")
        extension = importlib.import_module("megatron.core.extensions.transformer_engine")
    assert extension.HAVE_TE
    assert extension.fused_topk_with_score_function is not None  # our router, taken since TE >= 2.7


# ---------------------------------------------------------------------------------------------- on the ranks
def _device() -> str:
    """This rank's device: the GPU under nccl (ranks of the ``gpu`` tests), else the CPU."""
    return str(device())


def _config(tp: int, fp8=None, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             use_cpu_initialization=_device() == "cpu",
                             params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, fp8=fp8,
                             fp8_amax_history_len=4, fp8_amax_compute_algo="max", tensor_model_parallel_size=tp, **extra)


def _gpt(spec: str, tp: int, fp8=None, experts=None, **extra):
    """A fresh GPT (TE or local layer spec; with ``experts``, MoE layers: the TE spec's experts one grouped GEMM,
    the local spec's a loop of Megatron's MLPs) in a model-parallel state of tensor-parallel size ``tp``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)  # the CPU initialization draws from the default generator
    model_parallel_cuda_manual_seed(1234, te_rng_tracker=True)
    moe = {} if experts is None else dict(num_experts=experts, moe_grouped_gemm=spec == "te")
    if experts is not None:  # top-2 routing, every token kept, no auxiliary loss: the loss is the model's alone;
        # no linear biases (Megatron 0.16's local expert MLP adds its bias in place into a view its own TP-region
        # Function returned, which autograd refuses)
        extra = dict(extra, num_moe_experts=experts, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                     moe_aux_loss_coeff=0.0, moe_grouped_gemm=spec == "te", add_bias_linear=False)
    if spec == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(**moe)
    else:
        layer_spec = get_gpt_layer_local_spec(**moe)
        if _device() == "cpu":  # Megatron's own core attention allocates on CUDA
            from megatron.core.extensions.transformer_engine import TEDotProductAttention

            layer_spec.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    model = GPTModel(config=_config(tp=tp, fp8=fp8, **extra), transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    return model.to(_device())  # as Megatron's training loop does (its plain torch layers start on the CPU)


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool).triu(diagonal=1)  # True: masked out
    return ids.to(_device()), positions.to(_device()), mask.to(_device())


def _loss(model, step: int, fp8=False):
    from megatron.core.fp8_utils import get_fp8_context

    ids, positions, mask = _batch(step)
    context = get_fp8_context(model.config) if fp8 else torch.enable_grad()
    with context:
        per_token = model(ids, positions, mask, labels=torch.roll(ids, -1, dims=1))
    return per_token.float().mean()


def _train(model, steps: int, fp8=False):
    """Losses of ``steps`` SGD steps on one batch (learnable: the model memorizes it)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = _loss(model, step=0, fp8=fp8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


#: local-spec name -> TE-spec name, where the TE spec fuses the norm into the next linear
_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _te_name(local_name: str, moe: bool = False) -> str:
    """The TE-spec name of a local-spec parameter (MoE: the pre-MLP norm stays apart, expert i's weights are the
    grouped GEMM's ``weight{i}`` / ``bias{i}``)."""
    if moe:
        grouped = re.sub(r"experts\.local_experts\.(\d+)\.(linear_fc\d)\.(weight|bias)$", r"experts.\2.\3\1", local_name)
        if grouped != local_name or "pre_mlp_layernorm" in local_name:
            return grouped
    for local, te in _NORMS.items():
        local_prefix = local + ("weight" if local_name.endswith("weight") else "bias")
        if local_name.endswith(local_prefix):
            return local_name[: -len(local_prefix)] + te + local_prefix.rsplit(".", 1)[1]
    return local_name


def te_spec_tracks_local_spec(steps: int):
    """(local losses, TE losses, TE FP8 losses) of three copies of one GPT trained on the same batches."""
    local = _gpt("local", tp=1)
    weights = {_te_name(name): p.detach().clone() for name, p in local.named_parameters()}
    models = {}
    for name, fp8 in (("te", None), ("te_fp8", "hybrid")):
        models[name] = _gpt("te", tp=1, fp8=fp8)
        params = dict(models[name].named_parameters())
        assert params.keys() == weights.keys(), sorted(set(params) ^ set(weights))
        with torch.no_grad():
            for key, value in weights.items():
                params[key].copy_(value)
    return _train(local, steps), _train(models["te"], steps), _train(models["te_fp8"], steps, fp8=True)


def moe_te_spec_tracks_local_spec(steps: int, fp8=None, fp8_recipe="delayed"):
    """(local losses, TE losses, one-call GroupedLinear forwards) of one MoE GPT (4 experts) built from both specs with
    the same weights and trained on the same batch: the TE spec's experts are one te.GroupedLinear per projection
    (under FP8, Megatron pads each expert's tokens to a multiple of 16 with Fp8Padding: the one-call FP8 path)."""
    from transformer_engine.pytorch.module._grouped_fp8_function import GroupedFp8Function

    local = _gpt("local", tp=1, experts=4)
    weights = {_te_name(name, moe=True): p.detach().clone() for name, p in local.named_parameters()}
    te_model = _gpt("te", tp=1, fp8=fp8, experts=4, **({} if fp8 is None else {"fp8_recipe": fp8_recipe}))
    params = dict(te_model.named_parameters())
    assert params.keys() == weights.keys(), sorted(set(params) ^ set(weights))
    with torch.no_grad():
        for key, value in weights.items():
            params[key].copy_(value)
    calls, forward = [], GroupedFp8Function.forward
    GroupedFp8Function.forward = staticmethod(lambda ctx, *args: calls.append(1) or forward(ctx, *args))
    try:
        return _train(local, steps), _train(te_model, steps, fp8=fp8 is not None), len(calls)
    finally:
        GroupedFp8Function.forward = staticmethod(forward)


def cpu_offloading_losses(steps: int):
    """(losses, losses with Megatron's cpu_offloading of the first layer, tensors offloaded) of one TE-spec GPT
    trained twice. Saved tensors of any size take the offload path (the model is tiny), and on the CPU CPU tensors
    do too (the unit tests' seam)."""
    from transformer_engine.pytorch import cpu_offload

    plain = _gpt("te", tp=1)
    weights = {name: p.detach().clone() for name, p in plain.named_parameters()}
    offloaded = _gpt("te", tp=1, cpu_offloading=True, cpu_offloading_num_layers=1, cpu_offloading_activations=True,
                     cpu_offloading_weights=False)
    with torch.no_grad():
        for name, p in offloaded.named_parameters():
            p.copy_(weights[name])
    saved = cpu_offload._DEVICE_TYPES, cpu_offload._MIN_BYTES, cpu_offload._Stash.offload
    count = []
    cpu_offload._MIN_BYTES = 0
    if _device() == "cpu":
        cpu_offload._DEVICE_TYPES = ("cpu",)
    cpu_offload._Stash.offload = lambda stash, stream: (count.append(1), saved[2](stash, stream))[1]
    try:
        return _train(plain, steps), _train(offloaded, steps), len(count)
    finally:
        cpu_offload._DEVICE_TYPES, cpu_offload._MIN_BYTES, cpu_offload._Stash.offload = saved


def te_spec_loss_at(tp: int, full_weights=None):
    """(loss, full weights) of the TE-spec GPT at tensor-parallel size ``tp``; ``full_weights`` (the TP=1
    model's) are sharded into it along each parameter's ``partition_dim``."""
    from megatron.core import parallel_state

    model = _gpt("te", tp=tp)
    rank = parallel_state.get_tensor_model_parallel_rank()
    if full_weights is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                full = full_weights[name].to(p.device)
                if getattr(p, "tensor_model_parallel", False):
                    full = full.chunk(tp, dim=p.partition_dim)[rank]
                assert full.shape == p.shape, (name, full.shape, p.shape)
                p.copy_(full)
    loss = _loss(model, step=0)
    return loss.item(), {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_te_spec_gpt_tracks_the_local_spec(backend):
    local, te, te_fp8 = get_pool(1, backend).run(te_spec_tracks_local_spec, 12, timeout=300)[0]
    # same weights, same math in float32: the TE layers compute Megatron's own layers' losses, step after step
    torch.testing.assert_close(torch.tensor(te), torch.tensor(local), rtol=1e-4, atol=1e-5)
    # FP8 (E4M3 forward, E5M2 gradients, delayed scaling): the first loss is float32's to FP8 precision, and
    # it learns as float32 does (12 steps of SGD on one batch; the trajectories part after a few steps)
    assert te_fp8[0] == pytest.approx(local[0], rel=0.01)
    assert min(te_fp8[-4:]) < local[0] - 1.0 and min(local[-4:]) < local[0] - 1.0


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_te_spec_gpt_at_tensor_parallel_2_matches_one_rank(backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("tensor parallelism 2 over nccl needs 2 GPUs")
    pool = get_pool(2, backend)
    (loss_tp1, weights), _ = pool.run(te_spec_loss_at, 1, timeout=300)
    losses = [loss for loss, _ in pool.run(te_spec_loss_at, 2, weights, timeout=300)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert losses[0] == pytest.approx(loss_tp1, rel=1e-5)


@pytest.mark.gpu
def test_moe_te_spec_with_grouped_gemm_tracks_the_local_spec():
    """MoE layers (4 experts, top-2; Megatron's router moves its weights to the GPU, so no CPU variant): the TE
    spec's grouped GEMM experts compute the losses of Megatron's own expert MLPs with the same weights, float32."""
    local, te, _ = get_pool(1, "nccl").run(moe_te_spec_tracks_local_spec, 8, timeout=300)[0]
    torch.testing.assert_close(torch.tensor(te), torch.tensor(local), rtol=1e-4, atol=1e-5)
    assert min(te[-3:]) < te[0] - 0.5  # and it learns


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_recipe", ["delayed", "tensorwise"])
def test_moe_te_spec_in_fp8_learns_as_the_local_spec(fp8_recipe):
    """The same MoE GPT with Megatron's fp8="hybrid" under its delayed and tensorwise (current scaling) recipes: its
    experts' GroupedLinear runs one call per pass (the padded splits), the first loss is float32's to FP8 precision,
    and it learns."""
    local, te_fp8, one_call_forwards = get_pool(1, "nccl").run(moe_te_spec_tracks_local_spec, 8, "hybrid", fp8_recipe,
                                                               timeout=300)[0]
    assert one_call_forwards > 0
    assert te_fp8[0] == pytest.approx(local[0], rel=0.01)
    assert min(te_fp8[-3:]) < te_fp8[0] - 0.5


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_cpu_offloading_trains_as_without(backend):
    """Megatron's cpu_offloading (which calls te.get_cpu_offload_context and its sync after every layer): the same
    losses as without (on the CPU nothing moves, on a GPU the first layer's activations wait in host memory)."""
    plain, offloaded, count = get_pool(1, backend).run(cpu_offloading_losses, 4, timeout=300)[0]
    assert offloaded == plain and count > 0


def test_fp8_weight_helpers_of_megatron_run_on_our_tensors():
    """Megatron's fp8_utils (its distributed optimizer with FP8 weights: the bytes moved into its flat buffer, the
    master shards cast back) and its CUDA-graph support (TE's graph helpers present) on our package."""
    import transformer_engine.pytorch as te
    from megatron.core import fp8_utils
    from megatron.core.transformer import cuda_graphs
    from transformer_engine.common.recipe import Float8CurrentScaling

    assert cuda_graphs.HAVE_TE_GRAPHS
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        weight = te.Linear(64, 32).weight
    assert fp8_utils.is_float8tensor(weight)
    flat = torch.zeros(2 * weight.numel(), dtype=torch.uint8)
    fp8_utils.modify_underlying_storage(weight, flat[weight.numel():].view(weight.shape))
    master = torch.randn(weight.numel()) * 0.05
    fp8_utils.quantize_param_shard([weight], [master], [0], None)
    expected = weight._get_quantizer().quantize_impl(master.view(weight.shape).to(weight.dtype))
    assert torch.equal(flat[weight.numel():], expected._data.view(-1)) and torch.equal(weight._scale_inv, expected._scale_inv)
