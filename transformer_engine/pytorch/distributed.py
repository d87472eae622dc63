"""Activation recomputation (``checkpoint``) and named RNG streams (``CudaRNGStatesTracker``).

``checkpoint(function, *args)`` runs ``function`` without keeping its activations and runs it again in
the backward pass. The second run must compute exactly what the first did:

- RNG: the CPU and CUDA generator states and the tracker's named states are captured before the
  first run and put back for the second (so dropout draws the same masks);
- FP8: the second run happens in backward, outside the user's ``autocast``: it re-enters the
  autocast setting of the first run, and every module with delayed-scaling state casts with the
  scale it used in the first run (the outermost autocast exit has moved the scale on since). The
  state the second run leaves behind (amaxes it records, the swapped scales) is rolled back, so the
  scaling history advances once per step, as without checkpointing. (An autocast *inside* a
  reentrant checkpoint exits its first run under no_grad, which skips its update, as in TE: keep
  the autocast outside, or use ``use_reentrant=False``.)

``distribute_saved_activations=True`` (reentrant form): the region's first tensor input is kept as this
rank's 1/P of it over ``tp_group`` (the default group if None) and all-gathered again before the
recomputation (:mod:`.parallel.comm`), so P tensor-parallel ranks keep one copy of it between them.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.utils.checkpoint as _torch_checkpoint

from ._fp8_recompute import ScaleRecord, activation_recompute_forward
from .parallel.comm import gather_saved_activation, group_size, split_saved_activation
from .quantization import FP8GlobalStateManager, autocast, current_config

__all__ = [
    "CudaRNGStatesTracker", "activation_recompute_forward", "checkpoint", "get_all_rng_states", "in_fp8_activation_recompute_phase",
    "is_fp8_activation_recompute_enabled", "set_all_rng_states",
]

is_fp8_activation_recompute_enabled = FP8GlobalStateManager.is_fp8_activation_recompute_enabled
in_fp8_activation_recompute_phase = FP8GlobalStateManager.in_fp8_activation_recompute_phase


def _rng_device_type() -> str:
    """The generator the tracker manages: CUDA's when a GPU is present, else the CPU's."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_rng_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _graph_safe(device_type: str) -> bool:
    """True where the tracker's CUDA streams are generator objects swapped in with ``graphsafe_set_state``
    (PyTorch >= 2.4): CUDA-graph capture forbids ``set_rng_state``, and a graph replays the streams it
    registered (``CUDAGraph.register_generator_state``) with fresh Philox offsets."""
    return (device_type == "cuda" and hasattr(torch.Generator, "graphsafe_set_state")
            and hasattr(torch.cuda.CUDAGraph, "register_generator_state"))


def _cuda_generator() -> torch.Generator:
    index = torch.cuda.current_device()  # first: it initializes CUDA, which creates the default generators
    return torch.cuda.default_generators[index]


def _assign(states: Dict[str, object], name: str, state) -> None:
    """``states[name] = state``; a generator stream keeps its object (graphs may have registered it) and
    takes the values of ``state``."""
    current = states.get(name)
    if isinstance(current, torch.Generator) and isinstance(state, torch.Generator):
        current.set_state(state.get_state())
    else:
        states[name] = state


class CudaRNGStatesTracker:
    """Named RNG streams: ``fork(name)`` runs a block on stream ``name`` and leaves the default one untouched.

    Used for model-parallel dropout (each tensor-parallel rank draws different attention-dropout masks
    from its own stream). Streams live on the CUDA generator when a GPU is present, else on the CPU
    generator, so the same code runs on CPU. On a GPU each stream is a generator state object that
    ``fork`` swaps in with ``graphsafe_set_state`` (where PyTorch has it), so forks work inside CUDA-graph
    capture; ``make_graphed_callables`` registers the streams with its graphs, which replay them with
    fresh draws.

    Example:
        >>> tracker = CudaRNGStatesTracker()
        >>> tracker.add("model-parallel-rng", 1234)
        >>> with tracker.fork():
        ...     a = torch.rand(2)
        >>> tracker.reset(); tracker.add("model-parallel-rng", 1234)
        >>> with tracker.fork():
        ...     torch.equal(a, torch.rand(2))
        True
    """

    def __init__(self):
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()
        _TRACKERS.add(self)

    def is_initialized(self) -> bool:
        """True once a stream has been added."""
        return bool(self.states_)

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> generator state map (to restore later with :meth:`set_states`)."""
        return {name: state.clone_state() if isinstance(state, torch.Generator) else state for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace the streams by ``states`` (as returned by :meth:`get_states`)."""
        current, self.states_ = self.states_, {}
        for name, state in states.items():
            if name in current:
                self.states_[name] = current[name]
            _assign(self.states_, name, state)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: the seed or the name is already in use.
        """
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} is already used by another stream; pick a distinct seed")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first or pick another name")
        self.seeds_.add(seed)
        device_type = _rng_device_type()
        if _graph_safe(device_type):
            stream = _cuda_generator().clone_state()
            stream.manual_seed(seed)
            self.states_[name] = stream
            return
        saved = _get_rng_state(device_type)
        try:
            if device_type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states_[name] = _get_rng_state(device_type)
        finally:
            _set_rng_state(device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        """Run the block on stream ``name``; the stream advances, the default generator does not.

        Raises:
            ValueError: stream ``name`` was never added.
        """
        if name not in self.states_:
            raise ValueError(f"RNG stream {name!r} was not added; call add({name!r}, seed) first")
        stream = self.states_[name]
        if isinstance(stream, torch.Generator):  # advances in place
            generator = _cuda_generator()
            saved_stream = generator.graphsafe_get_state()
            generator.graphsafe_set_state(stream)
            try:
                yield
            finally:
                generator.graphsafe_set_state(saved_stream)
        else:
            device_type = _rng_device_type()
            saved = _get_rng_state(device_type)
            _set_rng_state(device_type, stream)
            try:
                yield
            finally:
                self.states_[name] = _get_rng_state(device_type)
                _set_rng_state(device_type, saved)


_TRACKERS: "weakref.WeakSet[CudaRNGStatesTracker]" = weakref.WeakSet()


def get_all_rng_states() -> Dict[str, torch.Tensor]:
    """The generator state of every named stream of every live :class:`CudaRNGStatesTracker` (name -> state),
    as its tracker last left it (TE's query for code that saves and restores all streams at once)."""
    return {name: state for tracker in list(_TRACKERS) for name, state in tracker.states_.items()}


def set_all_rng_states(states: Dict[str, torch.Tensor]) -> None:
    """Give each named stream of the live trackers the state ``states`` holds for its name.

    Raises:
        ValueError: a name in ``states`` is a stream of no live tracker (nothing is changed then).
    """
    trackers = list(_TRACKERS)
    unknown = [name for name in states if not any(name in t.states_ for t in trackers)]
    if unknown:
        raise ValueError(f"no CudaRNGStatesTracker has the streams {unknown}; add them first")
    for tracker in trackers:
        for name, state in states.items():
            if name in tracker.states_:
                _assign(tracker.states_, name, state)


class _RngSnapshot:
    """Generator states at one moment: the tracker's streams, and the CPU / CUDA default generators."""

    def __init__(self, tracker, include_default: bool):
        self.tracker = tracker
        self.streams = tracker.get_states() if tracker is not None else None
        self.cpu = torch.get_rng_state() if include_default else None
        cuda_ready = include_default and torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state() if cuda_ready else None

    def restore(self) -> None:
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        if self.tracker is not None:
            self.tracker.set_states(self.streams)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this snapshot's states, then go back to the states found on entry."""
        now = _RngSnapshot(self.tracker, include_default=self.cpu is not None)
        self.restore()
        try:
            yield
        finally:
            now.restore()


class _Fp8Replay(ScaleRecord):
    """The FP8 side of a checkpointed region: its autocast setting and the scales its modules cast with.

    ``recording()`` wraps the first run; ``replaying()`` wraps the second: it re-enters the recorded
    autocast setting (without its end-of-step update) and replays the scales (:class:`ScaleRecord`).
    """

    def __init__(self):
        super().__init__()
        self.config = current_config()

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        cfg = self.config
        with super().replaying(), autocast(cfg.enabled, cfg.calibrating, cfg.recipe, cfg.amax_reduction_group, _graph=True):
            yield


def _detach_inputs(args: Tuple) -> Tuple:
    out = []
    for arg in args:
        if torch.is_tensor(arg):
            detached = arg.detach()
            detached.requires_grad_(arg.requires_grad)
            out.append(detached)
        else:
            out.append(arg)
    return tuple(out)


class _CheckpointFunction(torch.autograd.Function):
    """Reentrant recomputation: forward without saving activations, backward = replay + autograd."""

    @staticmethod
    def forward(ctx, run_function, rng: _RngSnapshot, fp8: _Fp8Replay, kwargs, saved_group, *args):
        ctx.run_function, ctx.rng, ctx.fp8, ctx.kwargs = run_function, rng, fp8, kwargs
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.tensor_slots = [torch.is_tensor(a) for a in args]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.saved_group = saved_group if tensors else None
        if ctx.saved_group is not None:  # distribute_saved_activations: keep this rank's part of the first input
            ctx.first_input = (tensors[0].shape, tensors[0].requires_grad)
            tensors[0] = split_saved_activation(tensors[0], saved_group)
        ctx.save_for_backward(*tensors)
        with torch.no_grad(), fp8.recording():
            return run_function(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("te.checkpoint with use_reentrant=True is not compatible with torch.autograd.grad(); "
                               "use .backward() or use_reentrant=False")
        saved = list(ctx.saved_tensors)
        if ctx.saved_group is not None:
            shape, requires_grad = ctx.first_input
            saved[0] = gather_saved_activation(saved[0], shape, ctx.saved_group).requires_grad_(requires_grad)
        saved = iter(saved)
        args = tuple(next(saved) if is_tensor else other for is_tensor, other in zip(ctx.tensor_slots, ctx.others))
        inputs = _detach_inputs(args)
        with ctx.rng.replayed(), ctx.fp8.replaying(), torch.enable_grad():
            outputs = ctx.run_function(*inputs, **ctx.kwargs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        arg_grads = tuple(a.grad if torch.is_tensor(a) else None for a in inputs)
        return (None, None, None, None, None) + arg_grads


def _parse_legacy(args: Tuple, kwargs: Dict) -> Tuple[Tuple, Dict]:
    """TE's deprecated positional form ``checkpoint(fn, distribute_saved_activations, tracker, tp_group, *args)``."""
    if len(args) >= 3 and isinstance(args[0], bool):
        warnings.warn(
            "Passing distribute_saved_activations, get_rng_state_tracker and tp_group positionally to "
            "te.checkpoint is deprecated; pass them as keyword arguments",
            DeprecationWarning,
            stacklevel=3,
        )
        kwargs = dict(kwargs, distribute_saved_activations=args[0], get_rng_state_tracker=args[1], tp_group=args[2])
        args = args[3:]
    return args, kwargs


@contextlib.contextmanager
def _entered(*factories: Callable) -> Iterator[None]:
    """Enter the contexts made by ``factories``, in order, when this context is entered (not before)."""
    with contextlib.ExitStack() as stack:
        for factory in factories:
            stack.enter_context(factory())
        yield


def _nonreentrant_contexts(rng: _RngSnapshot, fp8: _Fp8Replay, user_context_fn: Optional[Callable]):
    """torch.utils.checkpoint ``context_fn``: FP8 recording / tracker + FP8 replay, around the user's contexts."""

    def context_fn():
        user_fwd, user_re = user_context_fn() if user_context_fn is not None else (contextlib.nullcontext(), contextlib.nullcontext())
        forward = _entered(lambda: user_fwd, fp8.recording)
        recompute = _entered(lambda: user_re, rng.replayed, fp8.replaying)
        return forward, recompute

    return context_fn


def checkpoint(function: Callable, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping activations; recompute it exactly in backward.

    Keyword-only extras (TE's): ``distribute_saved_activations=False``, ``get_rng_state_tracker=None``
    (its streams are replayed too), ``tp_group=None``, ``use_reentrant=True``; ``context_fn``,
    ``determinism_check`` and ``debug`` go to ``torch.utils.checkpoint`` (``use_reentrant=False``).
    The other keyword arguments go to ``function`` (not differentiated with ``use_reentrant=True``).
    See the module docstring for what "exactly" covers (RNG streams, FP8 scales).

    Raises:
        ValueError: ``distribute_saved_activations=True`` over several ranks with ``use_reentrant=False``.

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> checkpoint(layer, x).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    args, kwargs = _parse_legacy(args, kwargs)
    distribute = kwargs.pop("distribute_saved_activations", False)
    tracker_fn = kwargs.pop("get_rng_state_tracker", None)
    tp_group = kwargs.pop("tp_group", None)
    use_reentrant = kwargs.pop("use_reentrant", True)
    torch_options = {key: kwargs.pop(key) for key in ("context_fn", "determinism_check", "debug") if key in kwargs}
    group = torch.distributed.group.WORLD if tp_group is None else tp_group
    saved_group = group if distribute and group_size(group) > 1 else None
    if saved_group is not None and not use_reentrant:
        raise ValueError("distribute_saved_activations=True needs use_reentrant=True (te.checkpoint's own recomputation "
                         "splits and gathers the saved input)")
    tracker = tracker_fn() if tracker_fn is not None else None
    # torch.utils.checkpoint replays the default generators itself; the tracker's streams are ours
    rng, fp8 = _RngSnapshot(tracker, include_default=use_reentrant), _Fp8Replay()
    if use_reentrant:
        if torch_options:
            raise ValueError(f"{sorted(torch_options)} need use_reentrant=False")
        return _CheckpointFunction.apply(function, rng, fp8, kwargs, saved_group, *args)
    context_fn = _nonreentrant_contexts(rng, fp8, torch_options.pop("context_fn", None))
    return _torch_checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn, **torch_options, **kwargs)
