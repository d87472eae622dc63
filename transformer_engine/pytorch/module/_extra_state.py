"""``_extra_state`` of the modules: the delayed-scaling state as JSON in a uint8 tensor, no pickle.

A state dict saved with ``torch.save`` loads with ``torch.load(..., weights_only=True)``. Modules
without an amax history (high precision, current scaling) store ``torch.empty(0, dtype=torch.uint8)``,
as TE does. The payload (UTF-8 JSON)::

    {"format": "transformer_engine_fl.extra_state", "version": 1, "num_gemms": 1,
     "recipe": {"class": "DelayedScaling", "fields": {"margin": 0, "fp8_format": "HYBRID", ...}},
     "scaling_fwd": {"shape": [L, N], "scale": <b64>, "scale_inv": <b64>, "amax_history": <b64>},
     "scaling_bwd": {...}}

Tensors are base64 of little-endian float32 bytes, so values round-trip bit for bit. A recipe field
holding a callable (``amax_compute_algo``, ``scaling_factor_compute_algo``) is stored by name only
and comes back as the field's default; the autocast recipe supplies the callable at the next forward.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Dict

import torch

from transformer_engine.common.recipe import DelayedScaling, Format, Recipe

__all__ = ["ExtraState", "decode", "empty", "encode"]

_FORMAT = "transformer_engine_fl.extra_state"
_VERSION = 1
_RECIPES = {"DelayedScaling": DelayedScaling}
_TENSORS = ("scale", "scale_inv", "amax_history")


def empty() -> torch.Tensor:
    """The extra state of a module with nothing to checkpoint."""
    return torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class ExtraState:
    """A decoded payload: the recipe, the GEMM count and each direction's tensors (on the CPU)."""

    recipe: Recipe
    num_gemms: int
    scaling_fwd: Dict[str, torch.Tensor]
    scaling_bwd: Dict[str, torch.Tensor]


def _tensor_to_b64(t: torch.Tensor) -> str:
    raw = t.detach().to("cpu", torch.float32).contiguous().reshape(-1).view(torch.uint8)
    return base64.b64encode(bytes(raw.tolist())).decode("ascii")


def _b64_to_tensor(text: str, shape) -> torch.Tensor:
    raw = bytearray(base64.b64decode(text.encode("ascii"), validate=True))
    return torch.frombuffer(raw, dtype=torch.float32).clone().reshape(shape)


def _field_to_json(value):
    if isinstance(value, Format):
        return {"format": value.name}
    if callable(value):
        return {"callable": getattr(value, "__qualname__", repr(value))}
    return value


def _recipe_to_json(recipe: Recipe) -> Dict:
    fields = {f.name: _field_to_json(getattr(recipe, f.name)) for f in dataclasses.fields(recipe)}
    return {"class": type(recipe).__name__, "fields": fields}


def _recipe_from_json(obj: Dict) -> Recipe:
    name = obj["class"]
    if name not in _RECIPES:
        raise ValueError(f"the checkpoint's extra state names recipe {name!r}, which carries no scaling state")
    kwargs = {}
    for key, value in obj["fields"].items():
        if isinstance(value, dict) and "format" in value:
            kwargs[key] = Format[value["format"]]
        elif not (isinstance(value, dict) and "callable" in value):
            kwargs[key] = value
    return _RECIPES[name](**kwargs)


def _state_to_json(state) -> Dict:
    out = {"shape": list(state.amax_history.shape)}
    out.update({name: _tensor_to_b64(getattr(state, name)) for name in _TENSORS})
    return out


def _state_from_json(obj: Dict) -> Dict[str, torch.Tensor]:
    length, n = obj["shape"]
    shapes = {"scale": (n,), "scale_inv": (n,), "amax_history": (length, n)}
    return {name: _b64_to_tensor(obj[name], shapes[name]) for name in _TENSORS}


def encode(fp8_meta: Dict) -> torch.Tensor:
    """The uint8 tensor holding ``fp8_meta``'s delayed-scaling state."""
    payload = {
        "format": _FORMAT,
        "version": _VERSION,
        "num_gemms": fp8_meta["num_gemms"],
        "recipe": _recipe_to_json(fp8_meta["scaling_fwd"].recipe),
        "scaling_fwd": _state_to_json(fp8_meta["scaling_fwd"]),
        "scaling_bwd": _state_to_json(fp8_meta["scaling_bwd"]),
    }
    data = bytearray(json.dumps(payload, separators=(",", ":")).encode("utf-8"))
    return torch.frombuffer(data, dtype=torch.uint8).clone()


def decode(state: torch.Tensor) -> ExtraState:
    """Parse a tensor made by :func:`encode`.

    Raises:
        ValueError: for anything else, e.g. NVIDIA TE's pickled extra state, which is not loaded
            because unpickling can run arbitrary code.
    """
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise ValueError(f"_extra_state must be a uint8 tensor made by TransformerEngine-FL, got {type(state).__name__}")
    try:
        payload = json.loads(bytes(state.cpu().reshape(-1).tolist()).decode("utf-8"))
        if payload.get("format") != _FORMAT:
            raise KeyError("format")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError):
        raise ValueError(
            "_extra_state is not a TransformerEngine-FL payload (NVIDIA TE's pickled extra state is not loaded: "
            "unpickling can run arbitrary code); drop the '_extra_state' keys to load the weights only"
        ) from None
    if payload.get("version") != _VERSION:
        raise ValueError(f"_extra_state version {payload.get('version')!r} is not supported (expected {_VERSION})")
    return ExtraState(
        recipe=_recipe_from_json(payload["recipe"]),
        num_gemms=int(payload["num_gemms"]),
        scaling_fwd=_state_from_json(payload["scaling_fwd"]),
        scaling_bwd=_state_from_json(payload["scaling_bwd"]),
    )
