"""CPU offloading of activations: what autograd saves in a layer's forward waits in host memory until its
backward needs it (NVIDIA TE's ``get_cpu_offload_context``, which Megatron-Core calls for ``cpu_offloading``).

    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=n - 1, model_layers=n)
    for layer in layers:
        with context:
            x = layer(x)
        x = sync(x)

Rules:

- Layers are counted by the ``sync`` calls of a forward pass (0 .. model_layers - 1, then from 0 again).
  Layers 0 .. num_layers - 1 offload; the last ones keep their tensors on the GPU, since backward needs
  them first.
- Offloaded: each tensor saved for backward inside ``context`` (``torch.autograd.graph.saved_tensors_hooks``)
  during a forward pass (not a recomputation inside backward) that lives on a CUDA device, holds at least ``_MIN_BYTES`` (a smaller one
  saves less memory than its two
  copies cost in launches) and is neither a parameter nor a view of one (weights stay where they are).
- Forward: at ``sync`` after layer k its tensors are copied to pinned host memory on a side stream; their
  GPU memory goes back to PyTorch's allocator once that copy is done (``record_stream``), if nothing else
  holds them.
- Backward: ``sync``'s backward for layer k runs just before layer k's backward. It starts copying layer
  k's tensors back (and layer k - 1's, which comes next) on a second side stream; each tensor's unpack makes
  the computing stream wait for its own copy. A tensor whose reload was never started is copied back when
  unpacked.

Autograd values are unchanged: a reloaded tensor has the saved tensor's shape, strides and values.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["get_cpu_offload_context"]

#: Device types whose saved tensors are offloaded (host memory is where they go).
_DEVICE_TYPES = ("cuda",)
#: Saved tensors smaller than this stay where they are.
_MIN_BYTES = 1 << 20


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
) -> Tuple[contextlib.AbstractContextManager, Callable[[torch.Tensor], torch.Tensor]]:
    """(context to run each layer's forward in, ``sync(x)`` to call on each layer's output).

    Args:
        enabled: offload; False returns ``(nullcontext(), identity)``.
        num_layers: how many layers (the first ones of each forward) offload their activations.
        model_layers: how many layers run under the context per forward.
        offload_activations: must be True to offload anything.
        offload_weights: deprecated in NVIDIA TE and without effect there too (DeprecationWarning).
        double_buffering: NVIDIA TE reuses two sets of reload buffers; here reloads come from PyTorch's caching
            allocator, which already reuses the memory of earlier reloads (a warning says it changes nothing).

    Raises:
        ValueError: neither activations nor weights are to be offloaded, or (enabled) num_layers is not in
            [0, model_layers - 1].
    """
    if not offload_activations and not offload_weights:
        raise ValueError("get_cpu_offload_context: offload_activations and offload_weights are both False; nothing would be offloaded")
    if offload_weights:
        warnings.warn("get_cpu_offload_context(offload_weights=True) is deprecated (as in NVIDIA TE) and has no effect",
                      DeprecationWarning, stacklevel=2)
    if double_buffering:
        warnings.warn("get_cpu_offload_context(double_buffering=True) has no effect in TransformerEngine-FL: reloads are "
                      "allocated by PyTorch's caching allocator, which reuses the memory of earlier layers' reloads",
                      UserWarning, stacklevel=2)
    if not enabled or not offload_activations:
        return contextlib.nullcontext(), _identity
    if not 0 <= num_layers < model_layers:
        raise ValueError(
            f"get_cpu_offload_context(num_layers={num_layers}, model_layers={model_layers}): num_layers must be in "
            f"[0, model_layers - 1]; the last layer's activations are the first backward needs"
        )
    handler = _OffloadHandler(num_layers, model_layers)
    return _OffloadContext(handler), handler.sync


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _OffloadContext(torch.autograd.graph.saved_tensors_hooks):
    """The handler's saved-tensor hooks, with NVIDIA TE's ``inside_context`` flag (True while entered), which
    Megatron-Core's own linear layers read."""

    def __init__(self, handler: "_OffloadHandler"):
        super().__init__(handler.pack, handler.unpack)
        self.inside_context = False

    def __enter__(self):
        super().__enter__()
        self.inside_context = True
        return self

    def __exit__(self, *exc):
        self.inside_context = False
        return super().__exit__(*exc)


class _Stash:
    """One saved tensor: on its device until offloaded, then in host memory until reloaded."""

    __slots__ = ("tensor", "host", "device", "copied", "reloaded", "ready")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: Optional[torch.Tensor] = tensor
        self.device = tensor.device
        self.host: Optional[torch.Tensor] = None
        self.copied = self.ready = None  # CUDA events: host copy done, reload done
        self.reloaded: Optional[torch.Tensor] = None

    def offload(self, stream) -> None:
        """Copy to (pinned) host memory on ``stream`` and let go of the device tensor."""
        t = self.tensor
        self.host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)
        if t.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record(stream)
            t.record_stream(stream)  # its memory is not handed out again before the copy has read it
        else:
            self.host.copy_(t)
        self.tensor = None

    def reload(self, stream) -> None:
        """Start the copy back to the device on ``stream`` (once)."""
        if self.tensor is not None or self.reloaded is not None:
            return
        if self.device.type != "cuda":
            self.reloaded = self.host.to(self.device, copy=True)
            return
        with torch.cuda.stream(stream):
            stream.wait_event(self.copied)
            self.reloaded = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def get(self) -> torch.Tensor:
        """The tensor on its device, after the computing stream has waited for its reload."""
        if self.tensor is not None:
            return self.tensor
        if self.device.type != "cuda":
            self.reload(None)
            return self.reloaded
        current = torch.cuda.current_stream(self.device)
        self.reload(current)
        current.wait_event(self.ready)
        self.reloaded.record_stream(current)
        return self.reloaded


class _OffloadHandler:
    """The saved-tensor hooks and the layer boundaries of one offload context."""

    def __init__(self, num_layers: int, model_layers: int):
        self.num_layers, self.model_layers = num_layers, model_layers
        self.layer = 0  # index of the layer whose forward runs, counted by sync
        self.pending: List[_Stash] = []  # the stashes of that layer
        self.previous: List[_Stash] = []  # those of the layer before it (reloaded with it in backward)

    def pack(self, t: torch.Tensor):
        # inside a backward (a checkpointed layer recomputing its forward) no sync follows to offload it
        if self.layer >= self.num_layers or torch._C._current_graph_task_id() != -1 or not _offloadable(t):
            return t
        stash = _Stash(t)
        self.pending.append(stash)
        return stash

    @staticmethod
    def unpack(saved):
        return saved.get() if isinstance(saved, _Stash) else saved

    def sync(self, x: torch.Tensor) -> torch.Tensor:
        """The boundary after a layer's forward: offload its tensors (forward), reload them (backward)."""
        return _LayerBoundary.apply(x, self)

    def commit(self) -> Tuple[List[_Stash], List[_Stash]]:
        """Offload the finished layer's stashes; returns (them, the layer before's) for the backward reload."""
        group, previous = self.pending, self.previous
        for stash in group:
            stash.offload(_side_stream("offload", stash.device))
        self.pending, self.previous = [], group
        self.layer += 1
        if self.layer == self.model_layers:  # the next sync belongs to the next forward pass
            self.layer, self.previous = 0, []
        return group, previous


@functools.lru_cache(maxsize=None)
def _side_stream(role: str, device: torch.device):
    """The stream of the ``role`` copies ("offload", "reload") on ``device``, one per process (None off CUDA)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _offloadable(t: torch.Tensor) -> bool:
    """A saved tensor worth moving: on an offloaded device type, large enough, not a weight."""
    if t.device.type not in _DEVICE_TYPES or t.numel() * t.element_size() < _MIN_BYTES:
        return False
    return not (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter))


class _LayerBoundary(torch.autograd.Function):
    """Identity on x; forward offloads the layer just finished, backward starts its reload and the one before."""

    @staticmethod
    def forward(ctx, x, handler: _OffloadHandler):
        ctx.groups = handler.commit()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for group in ctx.groups:
            for stash in group:
                stash.reload(_side_stream("reload", stash.device))
        return grad, None
