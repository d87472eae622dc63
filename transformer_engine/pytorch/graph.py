"""``make_graphed_callables``: TE modules, FP8 included, captured as CUDA graphs (forward and backward).

A small layer costs more host time (Python, autograd, kernel launches) than GPU time, and a tensor-
parallel rank does all of the host work of its layer for a fraction of the GPU work. Captured once,
the forward and the backward of each callable replay as one CUDA graph each:

    layer = te.make_graphed_callables(layer, (x,), enabled=True, recipe=DelayedScaling())
    y = layer(x)            # copies x into the graph's input, replays the forward graph
    y.backward(dy)          # copies dy, replays the backward graph; dW accumulates into .grad

FP8: during capture each callable runs inside ``autocast(enabled, calibrating, recipe,
amax_reduction_group)`` on an empty autocast stack, so its casts, their amax records and its
delayed-scaling updates (the forward update at the autocast's exit, the backward update at the end of
its backward, the amax all-reduce) are inside the graphs: a replay advances the scaling state as an
eager step does. Warm-up steps (which compile the kernels and build the update plans) run first on a
side stream; the scaling states they touched get back the values they had before. Dropout draws from
the CUDA default generator, which advances its Philox offset at every replay.

FP8 weights cached over micro-batches (``cache_quantized_params=True``, NVIDIA TE's argument): each call
then takes ``is_first_microbatch`` (a bool). Each callable is captured twice, with its TE modules acting as
if called with ``is_first_microbatch=True`` (cast the FP8 weights into their cache) and with ``False``
(read the cache); a call replays the pair its argument names. The second pair reads the cache the first
writes, so the first micro-batch of a step must say True. Its price: two captures' memory (NVIDIA TE
captures once, with casts that a device-side flag turns into no-ops). Without FP8 there is nothing to
cache: one capture serves both values.

Rules (torch.cuda.make_graphed_callables's): arguments keep the sample's structure, shapes, dtypes and
devices (checked at every call); the outputs are the graph's static buffers, overwritten by the next
replay, so each forward's backward must run before the next forward of the same callable; the graph
reads parameters and scaling states in place, so replace none of them after capture (load
checkpoints first); a module runs its graph only in the training mode it was captured in, eagerly in
the other.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch.utils import _pytree as pytree

from transformer_engine.common.recipe import Recipe

from .distributed import get_all_rng_states
from .graph_state import is_graph_capturing, restore_fp8_tensors, save_fp8_tensors, scaling_tensors, set_capture_end, set_capture_start
from .graph_schedule import default_schedule, interleaved_schedule
from .module.base import first_microbatch
from .quantization.autocast import autocast, isolated_stack
from .quantization.delayed_update import hold_plans

__all__ = ["is_graph_capturing", "make_graphed_callables", "restore_fp8_tensors", "save_fp8_tensors", "set_capture_end",
           "set_capture_start"]

#: TE's deprecated argument names and the names that replace them.
_ALIASES = {
    "fp8_enabled": "enabled",
    "fp8_calibrating": "calibrating",
    "fp8_recipe": "recipe",
    "fp8_group": "amax_reduction_group",
    "fp8_weight_caching": "cache_quantized_params",
}


@dataclass(frozen=True)
class _Precision:
    """The autocast a callable is captured in."""

    enabled: bool
    calibrating: bool
    recipe: Optional[Recipe]
    amax_reduction_group: Any

    def autocast(self) -> autocast:
        return autocast(self.enabled, self.calibrating, self.recipe, self.amax_reduction_group)


@dataclass(frozen=True)
class _Capture:
    """What one callable's graphs read and write: inputs (user tensors, then parameters), outputs and
    their gradients, all static buffers owned by the graphs."""

    forward_graph: torch.cuda.CUDAGraph
    backward_graph: Optional[torch.cuda.CUDAGraph]  # None when no output needs a gradient
    inputs: Tuple[torch.Tensor, ...]
    num_user_inputs: int
    outputs: Tuple[torch.Tensor, ...]
    output_spec: pytree.TreeSpec
    grad_outputs: Tuple[Optional[torch.Tensor], ...]
    grad_inputs: Tuple[Optional[torch.Tensor], ...]


class _GraphedFunction(torch.autograd.Function):
    """One autograd node per call: forward replays the forward graph, backward the backward graph.

    The gradients returned are the static buffers themselves, not views of them: autograd then adds
    them into ``.grad`` (or copies them) instead of adopting a buffer the next replay overwrites.
    """

    @staticmethod
    def forward(ctx, capture: _Capture, *inputs: torch.Tensor):
        for static, given in zip(capture.inputs[: capture.num_user_inputs], inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        capture.forward_graph.replay()
        ctx.capture = capture
        outputs = tuple(o.detach() for o in capture.outputs)  # views: the buffers stay the graph's
        ctx.mark_non_differentiable(*[o for o, g in zip(outputs, capture.grad_outputs) if g is None])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        capture: _Capture = ctx.capture
        for static, grad in zip(capture.grad_outputs, grads):
            if static is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        if capture.backward_graph is not None:
            capture.backward_graph.replay()
        return (None,) + capture.grad_inputs


class _Graphed:
    """A captured callable: checks each call's arguments against the sample, then replays.

    ``captures`` maps the ``is_first_microbatch`` a call passes to the capture it replays: {None: capture}
    without weight caching (the argument is not taken), {True: ..., False: ...} with it."""

    def __init__(self, captures: Dict[Optional[bool], _Capture], arg_spec: pytree.TreeSpec, slots: Tuple[Any, ...],
                 held: List[Any], name: str):
        self.captures = captures
        self._arg_spec = arg_spec
        self._slots = slots  # per leaf of the sample arguments: a _TensorSlot, or the constant itself
        self._held = held  # the delayed-scaling plans and FP8 weight caches whose buffers the graphs use
        self._name = name

    def _capture_for(self, kwargs: dict) -> _Capture:
        """The capture this call replays (``is_first_microbatch`` taken out of ``kwargs`` under weight caching)."""
        if None in self.captures:
            return self.captures[None]
        first = kwargs.pop("is_first_microbatch", None)
        if not isinstance(first, bool):
            raise TypeError(
                f"{self._name}: captured with cache_quantized_params=True, each call takes is_first_microbatch=True "
                f"(cast the FP8 weights) or False (reuse them); got {first!r}"
            )
        return self.captures[first]

    def __call__(self, *args, **kwargs):
        capture = self._capture_for(kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._arg_spec:
            raise ValueError(f"{self._name}: the arguments' structure {spec} differs from the sample's {self._arg_spec}")
        tensors = []
        for index, (leaf, sample) in enumerate(zip(leaves, self._slots)):
            if isinstance(sample, _TensorSlot):
                sample.check(leaf, f"{self._name} argument {index}")
                tensors.append(leaf)
            elif not (leaf is sample or leaf == sample):
                raise ValueError(f"{self._name} argument {index} is {leaf!r}; it was captured as {sample!r} and must not change")
        outputs = _GraphedFunction.apply(capture, *tensors, *capture.inputs[capture.num_user_inputs:])
        return pytree.tree_unflatten(list(outputs), capture.output_spec)


@dataclass(frozen=True)
class _TensorSlot:
    """A tensor argument of the sample: the shape, dtype, device and requires_grad each call must match."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "_TensorSlot":
        return _TensorSlot(t.shape, t.dtype, t.device, t.requires_grad)

    def check(self, value, what: str) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what} is a {type(value).__name__}; it was captured as a tensor")
        found = _TensorSlot.of(value)
        if found != self:
            raise ValueError(f"{what} is {found}; the graph was captured with {self} (shapes are static in a CUDA graph)")


# Only the capturing thread's unsafe CUDA calls (synchronizations, allocations) invalidate a capture.
# Under "global" (torch's default) any thread's did: a NCCL watchdog querying an event or another
# library's background thread broke captures now and then (cuBLAS reported it, seen on the H200).
_CAPTURE_ERROR_MODE = "thread_local"


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    enabled: Union[None, bool, Sequence[bool]] = None,
    calibrating: Optional[bool] = None,
    recipe: Optional[Recipe] = None,
    amax_reduction_group=None,
    cache_quantized_params: Optional[bool] = None,
    pool=None,
    retain_graph_in_backward: bool = False,
    pre_warmup_hook: Optional[Callable[[], None]] = None,
    post_warmup_hook: Optional[Callable[[], None]] = None,
    _order: Optional[Sequence[int]] = None,
    _num_layers_per_chunk: Union[None, int, Sequence[int]] = None,
    **deprecated,
):
    """Capture modules or functions as CUDA graphs; returns their graphed versions (see the module docstring).

    Args:
        modules: a module or function, or a tuple of them (captured in that order, backward in the
            reverse order, sharing one memory pool: the order they run in each step).
        sample_args: a tuple of arguments, or one tuple per callable; tensors are graph inputs, the
            other values are constants of the capture.
        num_warmup_iters: eager forward + backward steps before capture.
        allow_unused_input: a tensor input or parameter that gets no gradient is not an error.
        sample_kwargs: a dict of keyword arguments, or one per callable (as ``sample_args``).
        enabled: capture in FP8 (a bool, or one per callable). calibrating: record amaxes in high
            precision. recipe: the FP8 recipe (None: the default recipe). amax_reduction_group: the
            group of the amax reduction.
        cache_quantized_params: cast the FP8 weights once per step: each call then takes ``is_first_microbatch``
            (True on a step's first micro-batch: cast and cache; False: reuse the cache), see the module docstring.
        pool: a memory pool handle shared with other graphs (``torch.cuda.graph_pool_handle()``).
        retain_graph_in_backward: keep the autograd graph of the backward capture.
        pre_warmup_hook, post_warmup_hook: called before and after the warm-up steps.
        _order, _num_layers_per_chunk: capture for interleaved pipeline parallelism (NVIDIA TE's private
            arguments, which Megatron-Core passes): the callables are layers in model chunks, ``_order``
            the pipeline schedule; ``sample_args`` then holds one entry per (layer, micro-batch) and one
            graphed function is returned per entry (see :mod:`.graph_schedule`).
        **deprecated: TE's old names ``fp8_enabled``, ``fp8_calibrating``, ``fp8_recipe``,
            ``fp8_group``, ``fp8_weight_caching`` (DeprecationWarning).

    Returns:
        The module (its ``forward`` replaced) or a graphed function, or a tuple of them (with ``_order``: a
        tuple of graphed functions, one per entry).

    Raises:
        RuntimeError: no CUDA device.
        ValueError / TypeError: inconsistent arguments (both a name and its deprecated alias, counts
            that differ, a sample tensor off the GPU or a non-tensor output).
    """
    values = _resolve_aliases(deprecated, enabled=enabled, calibrating=calibrating, recipe=recipe,
                              amax_reduction_group=amax_reduction_group, cache_quantized_params=cache_quantized_params)
    callables = modules if isinstance(modules, tuple) else (modules,)
    single = not isinstance(modules, tuple) and _order is None
    schedule = default_schedule(len(callables)) if _order is None else interleaved_schedule(_order, _num_layers_per_chunk, len(callables))
    entries = [callables[i] for i in schedule.callable_of]
    args_per = _per_callable(sample_args, len(entries), single, "sample_args", tuple)
    kwargs_per = _per_callable(sample_kwargs, len(entries), single, "sample_kwargs", dict)
    per_callable = _precisions(values, len(callables))
    precisions = [per_callable[i] for i in schedule.callable_of]
    caching = bool(values["cache_quantized_params"])
    # one capture per is_first_microbatch value when a callable runs in FP8; without FP8 both replay one capture
    variants = (True, False) if caching and any(p.enabled for p in precisions) else (None,)
    if variants[0] is not None and len({id(c) for c in entries}) < len(entries):
        raise NotImplementedError(
            "cache_quantized_params=True with a callable captured more than once (several micro-batches of _order, or "
            "one module given twice) is not implemented: each capture would cast into a weight cache of its own that "
            "the others read; pass cache_quantized_params=False"
        )
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs a CUDA GPU: CUDA graphs do not exist on the CPU")
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    set_capture_start()
    try:
        captures, held = _capture_all(entries, args_per, kwargs_per, precisions, pool,
                                      _Options(num_warmup_iters, allow_unused_input, retain_graph_in_backward,
                                               pre_warmup_hook, post_warmup_hook), schedule.steps, variants)
    finally:
        set_capture_end()
    if caching and variants == (None,):
        captures = [{True: c[None], False: c[None]} for c in captures]
    graphed = [_wrap(*each, held, replace_forward=_order is None) for each in zip(entries, captures, args_per, kwargs_per)]
    return graphed[0] if single else tuple(graphed)


@dataclass(frozen=True)
class _Options:
    num_warmup_iters: int
    allow_unused_input: bool
    retain_graph_in_backward: bool
    pre_warmup_hook: Optional[Callable[[], None]]
    post_warmup_hook: Optional[Callable[[], None]]


def _resolve_aliases(deprecated: Dict[str, Any], **values) -> Dict[str, Any]:
    """``values`` with TE's deprecated names folded in; TypeError for an unknown name, ValueError for a name
    given twice (deprecated and new)."""
    for old, value in deprecated.items():
        if old not in _ALIASES:
            raise TypeError(f"make_graphed_callables() got an unexpected keyword argument {old!r}")
        new = _ALIASES[old]
        if values[new] is not None:
            raise ValueError(f"both {old}= and {new}= were given; {old} is the deprecated name of {new}: pass only {new}")
        warnings.warn(f"make_graphed_callables({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=3)
        values[new] = value
    return values


def _per_callable(value, count: int, single: bool, what: str, kind: type) -> Tuple:
    """One ``kind`` (tuple of args / dict of kwargs) per callable, from ``value`` as the caller gave it (lists
    of args taken as tuples, as NVIDIA TE takes them)."""
    if value is None:
        return tuple(kind() for _ in range(count))
    if kind is tuple:
        value = tuple(value) if isinstance(value, list) else value
        if not single and isinstance(value, tuple):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    per = (value,) if single else value
    if not isinstance(per, tuple) or len(per) != count or not all(isinstance(v, kind) for v in per):
        shape = f"a {kind.__name__}" if single else f"a tuple of {count} {kind.__name__}s, one per callable"
        raise TypeError(f"{what} must be {shape}; got {type(value).__name__}")
    return per


def _precisions(values: Dict[str, Any], count: int) -> Tuple[_Precision, ...]:
    """The capture autocast of each callable (``enabled`` may be given per callable)."""
    enabled = values["enabled"]
    enabled = (bool(enabled),) * count if not isinstance(enabled, (tuple, list)) else tuple(bool(e) for e in enabled)
    if len(enabled) != count:
        raise ValueError(f"enabled has {len(enabled)} entries for {count} callables")
    calibrating = bool(values["calibrating"])
    return tuple(_Precision(e, calibrating, values["recipe"], values["amax_reduction_group"]) for e in enabled)


def _capture_all(callables, args_per, kwargs_per, precisions, pool, options: _Options, steps: Sequence[Tuple[bool, int]],
                 variants: Tuple[Optional[bool], ...]) -> Tuple[List[Dict[Optional[bool], _Capture]], List[Any]]:
    """Warm up, restore the scaling states, then capture each callable's forward and backward in the order
    of ``steps`` ((forward?, index) pairs, :mod:`.graph_schedule`), once per ``variants`` entry (the default
    ``is_first_microbatch`` of the modules, see :func:`~.module.base.first_microbatch`), in that order."""
    surfaces = [_input_surface(c, args, kwargs, i) for i, (c, args, kwargs) in enumerate(zip(callables, args_per, kwargs_per))]
    runs = [_runner(c, args, kwargs, p) for c, args, kwargs, p in zip(callables, args_per, kwargs_per, precisions)]
    saved = _ScalingSnapshot()
    captures: List[Dict[Optional[bool], _Capture]] = [{} for _ in runs]
    with isolated_stack(saved.note), hold_plans() as held:
        if options.pre_warmup_hook is not None:
            options.pre_warmup_hook()
        _warm_up(runs, surfaces, options, variants)
        if options.post_warmup_hook is not None:
            options.post_warmup_hook()
        saved.restore()
        for variant in variants:
            forwards = [None] * len(runs)
            with first_microbatch(variant):
                for forward, index in steps:
                    if not forward:
                        captures[index][variant] = _capture_backward(forwards[index], surfaces[index], pool, options)
                        continue
                    graph = _new_graph()
                    with _capturing(graph, pool):
                        outputs = runs[index]()
                    forwards[index] = (graph, *_flat_outputs(outputs))
            if variant:  # the FP8 weight caches those graphs write (and the next ones read) live as long as the graphs
                held.extend(dict(m._weight_cache) for c in callables if isinstance(c, torch.nn.Module)
                            for m in c.modules() if getattr(m, "_weight_cache", None))
    return captures, held


@contextlib.contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool)`` with Python's cyclic garbage collector paused inside.

    A collection that runs during a capture can free the last reference to an earlier CUDA graph (kept in a
    reference cycle until then): its private memory pool is released with ``cudaFree``, which a capture
    forbids, and the capture fails ("operation failed due to a previous error during capture"), at a point
    that depends on when the collector happens to run (seen in NVIDIA TE's CUDA-graph tests on an H100: torch
    collects before a capture only under ``torch.compiler.config.force_cudagraph_gc``). Garbage waits for the
    next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=_CAPTURE_ERROR_MODE):
            yield
    finally:
        if enabled:
            gc.enable()


def _new_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph that replays the named RNG streams of the live ``CudaRNGStatesTracker`` s (registered
    generator states: each replay draws anew, as the default generator does)."""
    graph = torch.cuda.CUDAGraph()
    for stream in get_all_rng_states().values():
        if isinstance(stream, torch.Generator):
            graph.register_generator_state(stream)
    return graph


def _capture_backward(forward, surface: Tuple[Tuple[torch.Tensor, ...], int], pool, options: _Options) -> _Capture:
    """The backward graph of one callable: d(outputs that need grad) -> d(inputs that need grad)."""
    forward_graph, outputs, spec = forward
    inputs, num_user = surface
    grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outputs)
    wanted = tuple(i for i in inputs if i.requires_grad)
    graph = None
    grads: Sequence[Optional[torch.Tensor]] = ()
    if any(g is not None for g in grad_outputs) and wanted:
        graph = _new_graph()
        with _capturing(graph, pool):
            grads = torch.autograd.grad(
                [o for o in outputs if o.requires_grad], wanted, [g for g in grad_outputs if g is not None],
                retain_graph=options.retain_graph_in_backward, allow_unused=options.allow_unused_input,
            )  # fmt: skip
    grads_iter = iter(grads)
    grad_inputs = tuple(next(grads_iter, None) if i.requires_grad else None for i in inputs)
    # detached, the outputs let the capture's autograd graph go: it holds the parameters' gradient
    # accumulators, made on the capture's side stream, which later backward passes would otherwise use
    outputs = tuple(o.detach() for o in outputs)
    return _Capture(forward_graph, graph, inputs, num_user, outputs, spec, grad_outputs, grad_inputs)


def _warm_up(runs, surfaces, options: _Options, variants: Tuple[Optional[bool], ...]) -> None:
    """``num_warmup_iters`` eager forward + backward steps of each callable on a side stream, the ``variants``
    taking turns (each capture's code path runs before it is captured)."""
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for run, (inputs, _) in zip(runs, surfaces):
            for step in range(options.num_warmup_iters):
                with first_microbatch(variants[step % len(variants)]):
                    outputs = [o for o in pytree.tree_leaves(run()) if isinstance(o, torch.Tensor) and o.requires_grad]
                wanted = [i for i in inputs if i.requires_grad]
                if outputs and wanted:
                    # ones, not random gradients: warm-up must leave the caller's random streams where they were
                    torch.autograd.grad(outputs, wanted, [torch.ones_like(o) for o in outputs],
                                        allow_unused=options.allow_unused_input)
    torch.cuda.synchronize()


def _input_surface(c, args: tuple, kwargs: dict, index: int) -> Tuple[Tuple[torch.Tensor, ...], int]:
    """(the sample's tensor leaves followed by the module's parameters, the number of tensor leaves)."""
    tensors = tuple(leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor))
    for t in tensors:
        if not t.is_cuda:
            raise ValueError(f"callable {index}: a sample tensor is on {t.device}; CUDA graphs need every input on the GPU")
    params: Tuple[torch.Tensor, ...] = ()
    if isinstance(c, torch.nn.Module):
        if any(b.requires_grad for b in c.buffers()):
            raise ValueError(f"callable {index} ({type(c).__name__}) has a buffer that requires grad; only parameters may")
        params = tuple(c.parameters())
    return tensors + params, len(tensors)


def _runner(c, args: tuple, kwargs: dict, precision: _Precision) -> Callable[[], Any]:
    """The callable on its sample, inside its capture autocast."""

    def run():
        with precision.autocast():
            return c(*args, **kwargs)

    return run


def _flat_outputs(outputs) -> Tuple[Tuple[torch.Tensor, ...], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(outputs)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"a graphed callable must return tensors (in tuples, lists or dicts); it returned a {type(leaf).__name__}"
            )
    return tuple(leaves), spec


def _wrap(c, captures: Dict[Optional[bool], _Capture], args: tuple, kwargs: dict, held: List[Any], replace_forward: bool = True):
    """The graphed function, or the module with its forward replaced (eager in the other training mode); for a
    module captured once per micro-batch (not ``replace_forward``), that forward as a function of its own."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = tuple(_TensorSlot.of(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    name = type(c).__name__ if isinstance(c, torch.nn.Module) else getattr(c, "__name__", "callable")
    graphed = _Graphed(captures, spec, slots, held, f"graphed {name}")
    if not isinstance(c, torch.nn.Module):
        return graphed
    # the new forward refers to the module weakly: a module -> forward -> module cycle would keep the
    # module and its graphs alive until a garbage collection
    module_ref, training, bound = weakref.ref(c), c.training, c.forward
    eager = getattr(bound, "__func__", None)

    def forward(*call_args, **call_kwargs):
        module = module_ref()
        if module.training == training:
            return graphed(*call_args, **call_kwargs)
        return bound(*call_args, **call_kwargs) if eager is None else eager(module, *call_args, **call_kwargs)

    if not replace_forward:
        return forward
    c.forward = forward
    return c


class _ScalingSnapshot:
    """The delayed-scaling states that warm-up updates, with their values from before their first update."""

    def __init__(self):
        self._saved: Dict[int, Tuple[Any, Tuple[torch.Tensor, ...]]] = {}

    def note(self, state) -> None:
        if id(state) not in self._saved:
            self._saved[id(state)] = (state, tuple(t.clone() for t in scaling_tensors(state)))

    def restore(self) -> None:
        for state, values in self._saved.values():
            for tensor, value in zip(scaling_tensors(state), values):
                tensor.copy_(value)

