"""What FusedAdam and FusedSGD share: the cached tensor lists of a param group, ``zero_grad``'s flag."""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Generic, List, Optional, Tuple, TypeVar

import torch

__all__ = ["ParamListCache", "deprecated_set_grad_none", "resolve_set_to_none"]

Lists = TypeVar("Lists")


class ParamListCache(Generic[Lists]):
    """The tensor lists of each param group, rebuilt only when the parameters with a gradient change.

    ``build(params)`` makes the lists (parameters, states, ...) for the given parameters; gradients are
    gathered by the caller on every step since backward may allocate new ones. The cached lists hold
    the parameters, so the ids in a key cannot be reused while the entry exists.
    """

    def __init__(self, build: Callable[[List[torch.Tensor]], Lists]):
        self._build = build
        self._entries: Dict[int, Tuple[Tuple[int, ...], Lists]] = {}

    def get(self, group_index: int, params: List[torch.Tensor]) -> Lists:
        """The lists of group ``group_index`` for ``params`` (the group's parameters that have a gradient)."""
        key = tuple(map(id, params))
        entry = self._entries.get(group_index)
        if entry is None or entry[0] != key:
            entry = (key, self._build(params))
            self._entries[group_index] = entry
        return entry[1]

    def clear(self) -> None:
        """Forget every list (the state tensors were replaced, e.g. by ``load_state_dict``)."""
        self._entries.clear()


def deprecated_set_grad_none(optimizer: str, set_grad_none: Optional[bool]) -> Optional[bool]:
    """Warn that the constructor's ``set_grad_none`` is deprecated (when given); return it."""
    if set_grad_none is not None:
        warnings.warn(
            f"set_grad_none in the {optimizer} constructor is deprecated: pass set_to_none to zero_grad instead.",
            DeprecationWarning,
            stacklevel=3,
        )
    return set_grad_none


def resolve_set_to_none(optimizer: str, set_grad_none: Optional[bool], set_to_none: Optional[bool]) -> bool:
    """zero_grad's effective ``set_to_none``: the constructor's deprecated value if given, else the call's, else True.

    Raises:
        ValueError: both are given and disagree.
    """
    if set_grad_none is None:
        return True if set_to_none is None else set_to_none
    if set_to_none is not None and set_to_none != set_grad_none:
        raise ValueError(
            f"zero_grad(set_to_none={set_to_none}) but {optimizer} was built with set_grad_none={set_grad_none}; "
            "drop one of them"
        )
    return set_grad_none
