"""``_extra_state`` of the modules: NVIDIA TE's checkpoint format, loaded without running arbitrary code.

TE keeps a module's delayed-scaling state in its state dict as a uint8 tensor holding a pickled dict, which
Megatron-Core's distributed checkpoints split per expert and merge again (``TEGroupedLinear``)::

    {"recipe": DelayedScaling(...),
     "scale_fwd": float32 [N_fwd], "amax_history_fwd": float32 [L, N_fwd],
     "scale_bwd": float32 [N_bwd], "amax_history_bwd": float32 [L, N_bwd],
     "extra_fp8_variables": {"num_gemms": n, "fp8_checkpoint": True}}

Slots are GEMM-major (3 g + role forward, 2 g + role backward), except GroupedLinear's, which TE orders
role-major (role n + g); scale_inv is 1 / scale and not stored. Modules without an amax history store
``torch.empty(0, dtype=torch.uint8)``, as TE does. So checkpoints move both ways between NVIDIA TE and this
package, and Megatron-Core handles ours as it handles TE's.

Loading unpickles with an unpickler that builds only what the format holds (CPU tensors, the recipe dataclasses
and enums of ``transformer_engine.common.recipe``, plain containers) and refuses any other global, so a
checkpoint cannot run code. A recipe field holding a callable is saved as the field's default (a callable
cannot be stored by value); the autocast recipe brings the callable back at the next forward. Payloads of this
package's first format (JSON, before 2026-11-27) still load.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import io
import json
import pickle
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from transformer_engine.common import recipe as _recipe
from transformer_engine.common.recipe import DelayedScaling, Format, Recipe

from ..quantization.recipe_state import RecipeState
from .fp8_meta import install_states

__all__ = ["ExtraState", "decode", "empty", "encode", "load_states", "save_states"]

#: what a checkpoint's pickle may name from the recipe module: data classes and enums, no behaviour on load
_RECIPE_GLOBALS = frozenset(
    ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "Format",
     "_FormatHelper", "QParams", "MMParams"]
)


def empty() -> torch.Tensor:
    """The extra state of a module with nothing to checkpoint."""
    return torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class ExtraState:
    """A decoded payload: the recipe, the GEMM count and each direction's tensors (CPU, GEMM-major slots)."""

    recipe: Recipe
    num_gemms: int
    scaling_fwd: Dict[str, torch.Tensor]
    scaling_bwd: Dict[str, torch.Tensor]


def _roles(mode: str) -> int:
    return 3 if mode == "fwd" else 2


def _to_role_major(t: torch.Tensor, n: int, roles: int) -> torch.Tensor:
    """Slots R g + r of n GEMMs with R roles each (last dim) -> r n + g."""
    return t.reshape(*t.shape[:-1], n, roles).transpose(-1, -2).reshape(t.shape)


def _to_gemm_major(t: torch.Tensor, n: int, roles: int) -> torch.Tensor:
    """Slots r n + g (last dim) -> R g + r (the inverse of :func:`_to_role_major`)."""
    return t.reshape(*t.shape[:-1], roles, n).transpose(-1, -2).reshape(t.shape)


def _storable(recipe: Recipe) -> Recipe:
    """``recipe`` with every callable field at its default (what a pickle can hold by value)."""
    defaults = {f.name: f.default for f in dataclasses.fields(recipe) if callable(getattr(recipe, f.name))}
    return dataclasses.replace(recipe, **defaults) if defaults else recipe


def encode(fp8_meta: Dict, role_major: bool = False) -> torch.Tensor:
    """The uint8 tensor holding ``fp8_meta``'s delayed-scaling state in TE's format (``role_major``: GroupedLinear's
    slot order)."""
    n = fp8_meta["num_gemms"]
    state = {"recipe": _storable(fp8_meta["scaling_fwd"].recipe), "extra_fp8_variables": {"num_gemms": n, "fp8_checkpoint": True}}
    for mode in ("fwd", "bwd"):
        scaling = fp8_meta[f"scaling_{mode}"]
        for name, tensor in (("scale", scaling.scale), ("amax_history", scaling.amax_history)):
            tensor = tensor.detach().to("cpu", torch.float32)
            state[f"{name}_{mode}"] = (_to_role_major(tensor, n, _roles(mode)) if role_major else tensor).contiguous()
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def save_states(fp8_meta: Dict, role_major: bool = False) -> torch.Tensor:
    """A module's ``_extra_state``: :func:`encode` of ``fp8_meta`` when it holds an amax history worth checkpointing,
    else :func:`empty`."""
    return encode(fp8_meta, role_major=role_major) if fp8_meta["fp8_checkpoint"] else empty()


class _StateUnpickler(pickle.Unpickler):
    """Builds tensors, the recipe module's data classes and plain containers; any other global is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return torch._utils._rebuild_tensor_v2
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _recipe.__name__ and name in _RECIPE_GLOBALS:
            return getattr(_recipe, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint of scaling state never holds")


def _storage_from_bytes(data: bytes):
    """A tensor storage saved by ``torch.save``, read by its weights-only loader (torch's own helper reads it unrestricted)."""
    return torch.load(io.BytesIO(data), weights_only=True)


def decode(state: torch.Tensor, role_major: bool = False) -> ExtraState:
    """Parse a tensor made by :func:`encode` (or by NVIDIA TE, or by this package's first format).

    Raises:
        ValueError: a payload that is none of these (a pickle naming anything the format does not hold is not
            unpickled further: that could run code), or one without the delayed-scaling tensors.
    """
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise ValueError(f"_extra_state must be a uint8 tensor (TE's checkpoint format), got {type(state).__name__}")
    raw = state.detach().cpu().reshape(-1).numpy().tobytes()
    if raw[:1] == b"{":
        return _decode_json(raw)
    try:
        payload = _StateUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - any unreadable payload gets the same answer
        raise ValueError(f"_extra_state is not a checkpoint of TE's scaling state ({exc}); it was not loaded, since "
                         "unpickling arbitrary objects can run code; drop the '_extra_state' keys to load the weights only") from None
    keys = ("recipe", "scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
    if not isinstance(payload, dict) or any(key not in payload for key in keys):
        raise ValueError(f"_extra_state holds no delayed-scaling state (TE's keys {keys}); got "
                         f"{sorted(payload) if isinstance(payload, dict) else type(payload).__name__}")
    n = int(payload.get("extra_fp8_variables", {}).get("num_gemms", 1))
    tensors = {}
    for mode in ("fwd", "bwd"):
        scale, history = (payload[f"{name}_{mode}"].to(torch.float32) for name in ("scale", "amax_history"))
        if role_major:
            scale, history = _to_gemm_major(scale, n, _roles(mode)), _to_gemm_major(history, n, _roles(mode))
        tensors[mode] = {"scale": scale, "scale_inv": torch.reciprocal(scale), "amax_history": history}
    return ExtraState(recipe=payload["recipe"], num_gemms=n, scaling_fwd=tensors["fwd"], scaling_bwd=tensors["bwd"])


def load_states(state, fp8_meta: Dict, quantizers: Dict, current_recipe: Optional[Recipe], owner: str, device: torch.device,
                role_major: bool = False) -> bool:
    """Install the scaling states an ``_extra_state`` payload holds into ``fp8_meta`` (and rebuild ``quantizers``);
    False for an empty payload (or None), which restores nothing.

    ``current_recipe``: the recipe the owner runs (None: any), whose type the payload's must have.

    Raises:
        ValueError: a payload :func:`decode` refuses, another recipe type, GEMM count or slot count.
    """
    if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
        return False
    loaded = decode(state, role_major=role_major)
    if current_recipe is not None and type(current_recipe) is not type(loaded.recipe):
        raise ValueError(
            f"cannot load the _extra_state of a {type(loaded.recipe).__name__} checkpoint into {owner}, which uses "
            f"{type(current_recipe).__name__}; load a checkpoint saved with the same recipe, or leave out the '_extra_state' "
            "keys (load_state_dict(..., strict=False))"
        )
    n = fp8_meta["num_gemms"]
    if loaded.num_gemms != n:
        raise ValueError(f"the _extra_state holds {loaded.num_gemms} GEMMs but {owner} has {n}")
    states = [RecipeState.create(loaded.recipe, mode=m, num_gemms=n, device=device) for m in ("forward", "backward")]
    for scaling, tensors in zip(states, (loaded.scaling_fwd, loaded.scaling_bwd)):
        if tensors["amax_history"].shape[1] != scaling.num_quantizers:
            raise ValueError(f"the _extra_state has {tensors['amax_history'].shape[1]} {scaling.mode} slots, "
                             f"expected {scaling.num_quantizers}")
        for key, value in tensors.items():
            setattr(scaling, key, value.to(device))
    install_states(fp8_meta, quantizers, *states)
    return True


# ------------------------------------------------------------------------- the first format (JSON, read only)


def _b64_to_tensor(text: str, shape) -> torch.Tensor:
    raw = bytearray(base64.b64decode(text.encode("ascii"), validate=True))
    return torch.frombuffer(raw, dtype=torch.float32).clone().reshape(shape)


def _recipe_from_json(obj: Dict) -> Recipe:
    if obj["class"] != "DelayedScaling":
        raise ValueError(f"the checkpoint's extra state names recipe {obj['class']!r}, which carries no scaling state")
    kwargs = {}
    for key, value in obj["fields"].items():
        if isinstance(value, dict) and "format" in value:
            kwargs[key] = Format[value["format"]]
        elif not (isinstance(value, dict) and "callable" in value):
            kwargs[key] = value
    return DelayedScaling(**kwargs)


def _decode_json(raw: bytes) -> ExtraState:
    """The payload of this package's first format: {"format": "transformer_engine_fl.extra_state", "version": 1, ...}."""
    try:
        payload = json.loads(raw.decode("utf-8"))
        if payload.get("format") != "transformer_engine_fl.extra_state" or payload.get("version") != 1:
            raise KeyError("format")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError):
        raise ValueError("_extra_state is neither TE's checkpoint format nor this package's first one") from None
    tensors = {}
    for mode in ("fwd", "bwd"):
        obj = payload[f"scaling_{mode}"]
        length, n = obj["shape"]
        shapes = {"scale": (n,), "scale_inv": (n,), "amax_history": (length, n)}
        tensors[mode] = {name: _b64_to_tensor(obj[name], shape) for name, shape in shapes.items()}
    return ExtraState(recipe=_recipe_from_json(payload["recipe"]), num_gemms=int(payload["num_gemms"]),
                      scaling_fwd=tensors["fwd"], scaling_bwd=tensors["bwd"])
