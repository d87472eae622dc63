"""transformer_engine.pytorch.utils: NVIDIA TE's helpers that user code and TE's own tests import."""

import math

import pytest
import torch

from transformer_engine.pytorch import utils


def test_normal_initializers_draw_with_the_stated_std():
    torch.manual_seed(0)
    w = torch.empty(512, 512)
    for init, std in ((utils.init_method_normal(0.5), 0.5), (utils.scaled_init_method_normal(0.5, 8), 0.5 / math.sqrt(16)),
                      (utils.get_default_init_method(), 0.023)):
        out = init(w)
        assert out is w  # in place, as torch.nn.init
        assert abs(w.mean().item()) < 4 * std / 512 and w.std().item() == pytest.approx(std, rel=0.01)
    utils.init_method_constant(0.25)(w)
    assert (w == 0.25).all()


def test_integer_helpers_check_their_arguments():
    assert utils.divide(12, 4) == 3 and utils.round_up_to_nearest_multiple(33, 32) == 64 and utils.round_up_to_nearest_multiple(64,
                                                                                                                                32) == 64
    with pytest.raises(ValueError, match="13 is not divisible by 4"):
        utils.divide(13, 4)
    with pytest.raises(ValueError, match="zero"):
        utils.round_up_to_nearest_multiple(3, 0)


def test_cast_if_needed_and_attention_mask_func():
    x = torch.randn(3, requires_grad=True)
    assert utils.cast_if_needed(x, torch.float32) is x and utils.cast_if_needed(None, torch.float16) is None
    y = utils.cast_if_needed(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.requires_grad
    scores, mask = torch.zeros(2, 2), torch.tensor([[False, True], [False, False]])
    assert utils.attention_mask_func(scores, mask) is scores and scores[0, 1] == -10000.0 and scores.sum() == -10000.0


def test_devices_match_and_capability_without_a_gpu():
    assert utils.devices_match("cpu", torch.device("cpu")) and not utils.devices_match("cpu", "meta")
    if not torch.cuda.is_available():
        assert utils.get_device_compute_capability() == (0, 0) and not utils.is_bf16_compatible()
        assert not utils.is_non_tn_fp8_gemm_supported()


def test_make_weak_ref_passes_through_what_is_not_a_cuda_tensor():
    t = torch.ones(2)
    out = utils.make_weak_ref({"a": [t, None], "b": (1, 2.0, True)})
    assert out["a"][0] is t and out["a"][1] is None and out["b"] == (1, 2.0, True)
    with pytest.raises(TypeError, match="got str"):
        utils.make_weak_ref("x")


@pytest.mark.gpu
def test_make_weak_ref_shares_the_memory_without_keeping_it_alive():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.arange(1024 * 1024, device="cuda", dtype=torch.float32).to(torch.bfloat16).view(1024, 1024)
    weak = utils.make_weak_ref(x)
    assert weak.dtype == torch.bfloat16 and weak.shape == x.shape and weak.data_ptr() == x.data_ptr()
    x[0, 0] = 7.0
    assert weak[0, 0].item() == 7.0 and torch.equal(weak, x)
    with pytest.raises(ValueError, match="contiguous"):
        utils.make_weak_ref(x.t())
    before = torch.cuda.memory_allocated()
    del x  # the weak tensor does not hold the allocation
    assert torch.cuda.memory_allocated() == before - 1024 * 1024 * 2


def test_constants_gather_the_accepted_values_and_dtype_maps():
    from transformer_engine.pytorch import constants
    from transformer_engine.pytorch.tensor import DType

    assert constants.TE_DType[torch.float8_e4m3fn] is DType.kFloat8E4M3
    assert all(constants.TE_DType[torch_dtype] is te_dtype for te_dtype, torch_dtype in constants.TE_DType_To_Torch.items())
    assert constants.MXFP8_BLOCK_SCALING_SIZE == 32 and constants.NVFP4_BLOCK_SCALING_SIZE == 16
    assert "padding_causal_bottom_right" in constants.AttnMaskTypes and "alibi" in constants.AttnBiasTypes
    assert constants.dist_group_type is torch.distributed.ProcessGroup
