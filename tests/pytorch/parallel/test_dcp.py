"""torch.distributed.checkpoint: an FSDP2 model trained in FP8 (delayed scaling, so ``_extra_state`` carries
scales and amax histories) is saved at world size 2 and loaded at world sizes 2, 1 and 4.

- world size 2: the loaded model and optimizer resume bit-exact (the next step equals the step taken
  by the model that was saved);
- world sizes 1 and 4: parameters, optimizer state and FP8 state load bit-exact (resharded); the next
  step agrees with world size 2 up to the summation order of the gradient reduction.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import transformer_engine.pytorch as te
from tests.pytorch.parallel._ranks import device, get_pool
from tests.pytorch.parallel._tp import assert_close, split
from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.pytorch.parallel import ExtraStateLoadPlanner
from transformer_engine.pytorch.parallel.comm import group_size

ROWS, H, FFN, P_SAVE = 32, 32, 64, 2  # rows per rank at 1, 2, 4 ranks meet the FP8 shape rule


def _model(shard: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.LayerNormMLP(H, FFN, device=device()), te.Linear(H, H, device=device()))
    if shard:
        mesh = init_device_mesh(device().type, (group_size(None),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _step(model, opt, step: int, local: bool) -> None:
    torch.manual_seed(100 + step)
    x, target = torch.randn(ROWS, H, device=device()), torch.randn(ROWS, H, device=device())
    if local:
        x, target = split(x, "seq"), split(target, "seq")
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = model(x)
    # the squared error summed over this rank's rows, over the global row count: dy does not depend on
    # the world size (so neither do its FP8 casts with the saved scales); FSDP averages the ranks'
    # gradients, P times that average is the single-process gradient (P is a power of two: exact)
    (torch.sum((y - target) ** 2) / (ROWS * H)).backward()
    for param in model.parameters():
        param.grad.mul_(group_size(None) if local else 1)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _snapshot(model, opt) -> dict:
    """Full parameters, optimizer state and FP8 state (what must survive the checkpoint), on the CPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_state, optim_state = get_state_dict(model, opt, options=options)
    fp8 = {name: {f"{k}.{attr}": getattr(m.fp8_meta[k], attr).cpu().clone() for k in ("scaling_fwd", "scaling_bwd")
                  for attr in ("scale", "amax_history")}
           for name, m in model.named_modules() if getattr(m, "fp8_meta", {}).get("scaling_fwd") is not None}
    params = {k: v.detach().cpu().clone() for k, v in model_state.items() if not k.endswith("_extra_state")}
    return {"params": params, "fp8": fp8, "optim": _flat_optim(optim_state)}


def _flat_optim(optim_state) -> dict:
    return {f"{fqn}.{key}": value.detach().cpu().clone() for fqn, state in optim_state["state"].items()
            for key, value in state.items() if torch.is_tensor(value)}


def _states(model, opt):
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def check_save(path: str):
    model = _model(shard=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        _step(model, opt, step, local=True)
    dcp.save(_states(model, opt), checkpoint_id=path)
    saved = _snapshot(model, opt)
    _step(model, opt, 2, local=True)
    return saved, _snapshot(model, opt)


def _load(path: str, shard: bool):
    model = _model(shard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = _states(model, opt)
    dcp.load(state, checkpoint_id=path, planner=ExtraStateLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _assert_same(actual: dict, expected: dict) -> None:
    """Bit-exact: parameters, optimizer state, FP8 state."""
    for group in ("params", "optim"):
        assert actual[group].keys() == expected[group].keys(), group
        for key, value in expected[group].items():
            assert torch.equal(actual[group][key], value), f"{group} {key} differs"
    for module, tensors in expected["fp8"].items():
        for key, value in tensors.items():
            assert torch.equal(actual["fp8"][module][key], value), f"FP8 state {module} {key} differs"


def check_load(path: str, saved: dict, continued: dict):
    shard = dist.is_initialized()
    model, opt = _load(path, shard)
    _assert_same(_snapshot(model, opt), saved)
    _step(model, opt, 2, local=shard)
    after = _snapshot(model, opt)
    if shard and group_size(None) == P_SAVE:
        _assert_same(after, continued)
        return
    # another world size sums the gradients in another order: the step agrees up to fp32 rounding
    for key, value in continued["params"].items():
        assert_close(after["params"][key] - saved["params"][key], value - saved["params"][key], {"rel_err": 1e-4},
                     f"step of {key}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, state at the save, state one step later) of the world-size-2 run."""
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    saved, continued = get_pool(P_SAVE).run(check_save, path, timeout=120)[0]
    return path, saved, continued


def test_resume_at_the_same_world_size_is_bit_exact(checkpoint):
    get_pool(P_SAVE).run(check_load, *checkpoint, timeout=120)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_on_one_process(checkpoint):
    check_load(*checkpoint)


def test_load_on_four_ranks(checkpoint):
    get_pool(4).run(check_load, *checkpoint, timeout=120)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_default_planner_fails_on_extra_state_and_ours_does_not(checkpoint):
    path = checkpoint[0]
    model = _model(shard=False)
    with pytest.raises(BaseException, match=r"Size mismatch.*_extra_state"):  # DCP's CheckpointException is a BaseException
        dcp.load({"model": model.state_dict()}, checkpoint_id=path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=ExtraStateLoadPlanner())
    assert state["model"]["0._extra_state"].numel() > 0
    model.load_state_dict(state["model"])
    assert model[0].fp8_meta["scaling_fwd"] is not None
