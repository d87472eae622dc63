"""Rank-side helpers of the tensor-parallel tests: split full tensors into this rank's part, gather them back,
and compare a sharded module with its single-process twin.

The tensor-parallel group is the whole world. Layouts of an activation [s, b, h]:

- "full": every rank holds all of it;
- "seq": rank r holds rows [r s/P, (r+1) s/P) (sequence parallelism);
- "feat": rank r holds features [r h/P, (r+1) h/P) (between a column- and a row-parallel layer).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch

import transformer_engine.pytorch as te
from tests.utils import rel_err
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from transformer_engine.pytorch.parallel import full_tensor
from transformer_engine.pytorch.parallel.comm import all_gather, group_rank, group_size

__all__ = ["RECIPES", "gather", "assert_close", "compare_grads", "fp8_context", "split"]

RECIPES = {
    None: None,
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling,
    "block": Float8BlockScaling,
}


def fp8_context(recipe_name: Optional[str]):
    """te.autocast with the named recipe (amaxes MAX-reduced over the world), or nothing."""
    if recipe_name is None:
        return contextlib.nullcontext()
    return te.autocast(enabled=True, recipe=RECIPES[recipe_name]())


def split(t: torch.Tensor, layout: str) -> torch.Tensor:
    """This rank's part of a full tensor in ``layout``."""
    if layout == "full":
        return t.detach().clone()
    dim = 0 if layout == "seq" else -1
    return t.detach().chunk(group_size(None), dim=dim)[group_rank(None)].contiguous()


def gather(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The full tensor from every rank's part in ``layout``."""
    if layout == "full":
        return t.detach()
    if layout == "seq":
        return all_gather(t.detach().contiguous(), None)
    return all_gather(t.detach().movedim(-1, 0).contiguous(), None).movedim(0, -1)


# FP8 GEMMs on GPU tensor cores keep about 14 accumulator mantissa bits before cuBLAS promotes to
# float32 (DeepSeek-V3 report, 3.3.2), and a sharded GEMM sums its K dimension in another order than
# the unsharded one. Through a TransformerLayer these last-bit differences reach E5M2 gradient casts
# (2 mantissa bits), where a value near a rounding boundary flips by a whole step: measured on H200 +
# NCCL <= 7e-5 for one module, 2.2e-3 (2 ranks) and 9.2e-3 (4 ranks) for a TransformerLayer's layer-norm
# weight gradient. The CPU emulation accumulates exactly in float32 (measured <= 2e-7): it keeps 1e-5.
FP8_GPU_REL_ERR = 2.0**-5
# A gradient that is analytically zero (the key bias: adding one constant to every score of a softmax
# row changes nothing) is pure rounding noise, so on GPUs its error is measured against this fraction
# of the module's median gradient norm instead of against its own norm.
ZERO_GRAD_FLOOR = 1e-2


def delayed_fp8_tolerance() -> Dict:
    """Norm-wise tolerance of delayed-scaling FP8 results between sharded and unsharded runs."""
    return {"rel_err": 1e-5, "rel_err_cuda": FP8_GPU_REL_ERR}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Dict, what: str, gpu_norm_floor: float = 0.0) -> None:
    """``actual`` vs ``expected``: elementwise (rtol, atol) or, with "rel_err", the norm-wise relative error
    (``rel_err_cuda`` replaces it for tensors on a GPU, where the norm is taken as at least ``gpu_norm_floor``)."""
    if "rel_err" in tol:
        err = rel_err(expected, actual)
        if actual.is_cuda and gpu_norm_floor > 0:
            err = (actual.double() - expected.double()).norm().item() / max(expected.double().norm().item(), gpu_norm_floor)
        limit = tol.get("rel_err_cuda", tol["rel_err"]) if actual.is_cuda else tol["rel_err"]
        assert err <= limit, f"{what}: relative error {err:.3g} > {limit} (rank {group_rank(None)})"
        return
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what} (rank {group_rank(None)}): {m}", **tol)


def compare_grads(tp_module: torch.nn.Module, ref_module: torch.nn.Module, tol: Dict) -> None:
    """Every parameter gradient of ``tp_module`` (gathered when sharded) against ``ref_module``'s."""
    ref = dict(ref_module.named_parameters())
    floor = ZERO_GRAD_FLOOR * torch.stack([p.grad.double().norm() for p in ref.values()]).median().item()
    for name, param in tp_module.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert_close(full_tensor(param.grad, param, None), ref[name].grad, tol, f"grad of {name}", floor)
