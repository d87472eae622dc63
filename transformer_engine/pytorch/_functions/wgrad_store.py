"""Delayed weight gradients (TE's ``delay_wgrad_compute``): backward computes dgrad only and queues the wgrad GEMMs.

With a module built with ``delay_wgrad_compute=True``, its backward returns the input gradient (and the bias
gradient, which comes with dy's cast) and queues dW = dy^T @ x of each of its GEMMs, holding dy and x (FP8 under
autocast) until ``module.backward_dw()`` runs them: Megatron-Core overlaps them with the next layer's
communication that way. ``backward_dw`` runs the wgrads of the oldest backward not yet completed (one backward's
GEMMs per call, first in first out), puts each dW where it goes (``main_grad`` with ``fuse_wgrad_accumulation``,
else the weight parameters' ``.grad``, accumulated as autograd would) and then calls the hooks registered with
``register_wgrad_accumulation_and_reduce_hooks``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Deque, Iterator, List, Optional

import torch

__all__ = ["WeightGradStore", "backward_batch"]


class WeightGradStore:
    """The queue of a module's delayed wgrads (NVIDIA TE's class of that name and methods).

    Args:
        delay_wgrad_compute: queue the wgrads (True) or compute them in backward (False).
    """

    def __init__(self, delay_wgrad_compute: bool = False):
        self.enabled = bool(delay_wgrad_compute)
        self._batches: Deque[List[Callable[[], None]]] = deque()
        self._open: Optional[List[Callable[[], None]]] = None

    def delay_wgrad_compute(self) -> bool:
        """True when backward queues its wgrads."""
        return self.enabled

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """The wgrads :meth:`put` inside form one batch: those of one module backward."""
        self._open = []
        try:
            yield
        finally:
            batch, self._open = self._open, None
            if batch:
                self._batches.append(batch)

    def put(self, compute: Callable[[], None]) -> None:
        """Queue one wgrad (a call that computes dW and puts it where it goes), inside :meth:`backward`."""
        if self._open is None:
            raise RuntimeError("WeightGradStore.put outside a module backward")
        self._open.append(compute)

    def pop(self) -> None:
        """Run the wgrads of the oldest queued backward.

        Raises:
            RuntimeError: none is queued (``backward_dw`` called more often than backward ran).
        """
        if not self._batches:
            rank = f" (rank {torch.distributed.get_rank()})" if torch.distributed.is_available() and torch.distributed.is_initialized() \
                else ""
            raise RuntimeError(f"backward_dw(): no delayed weight gradient is queued{rank}; each backward queues one batch, "
                               "and backward_dw runs one")
        for compute in self._batches.popleft():
            compute()

    def assert_empty(self) -> None:
        """AssertionError when wgrads are still queued."""
        assert not self._batches, f"{len(self._batches)} backward(s) of delayed weight gradients are still queued"


def backward_batch(store: Optional[WeightGradStore]):
    """``store.backward()`` when ``store`` delays its wgrads, else a context that does nothing."""
    return store.backward() if store is not None else contextlib.nullcontext()
