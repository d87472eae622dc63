"""What ``torch.compile`` sees of a dispatched op: the tensor ops of a traceable implementation, or a custom op.

While Dynamo traces, ``ops.<name>(...)`` first asks the manager for the op's *compiled form*
(:meth:`~.core.manager.OpManager.compiled_form`, chosen once per trace for the key argument's device
and dtype): the implementation whose tensor ops the graph should hold - the reference backend's in
place of a flagos Triton kernel (Inductor generates and fuses that kernel itself), the cuBLASLt GEMM
through ``torch._scaled_mm``. Its code is traced inline, so Inductor fuses casts, amaxes, norms and
activations with their neighbours and launches them without our Python launchers.
``TE_FL_COMPILE_OPS=custom_op`` turns this off. Where no implementation traces, the op becomes one
custom op, as follows.

Eagerly, ``ops.<name>(...)`` is the dispatcher (:mod:`.core._dispatch`): a few dict lookups and the
implementation's call. Under ``torch.compile`` Dynamo cannot trace that path (a ``ContextVar`` for the
scoped policy, locks on a cache miss, Triton's launch machinery inside the flagos kernels), so each
op whose stub is annotated (see :mod:`.core.catalog`) is also registered as the custom op
``torch.ops.te_fl.<name>``, and :func:`traceable` returns a function that calls the dispatcher when
eager and that custom op while compiling. The graph then holds one node per op:

- its eager implementation is the default manager's dispatcher, so a compiled graph runs the same
  kernel, chosen by the same policy and fallback rules, as eager code (bit for bit);
- its fake implementation (shapes, dtypes and devices for tracing) is the ``reference`` backend's
  implementation run on fake tensors: the oracle states every op's output contract;
- it declares the arguments it writes in place (the stub's ``mutates``: ``amax_out``, ``out``), so
  functionalization orders the amax-history writes of delayed scaling like any in-place op.

A custom op returns new tensors only, while a catalog op may return None (``layernorm_fwd``'s
``scale_inv`` without FP8) or one of its arguments (``amax`` is ``amax_out`` when given). Both
travel as a *marker*, an empty bool tensor of shape [0, code, *view_shape]: code 0 stands for None,
code i + 1 for a view of the op's i-th argument (one it writes). Its shape is fixed when traced, so
:func:`_decode` restores the catalog's result there.

Ops whose stubs carry no annotations (attention, whose context object is backend-specific, and the
multi-tensor optimizer ops) stay eager: under ``torch.compile`` they end the graph (a graph break), unless the
catalog declares them ``traced`` (``attention_max_logit``: a configuration object in, a plain tensor out), whose
compiled form is traced as for an annotated op.
"""

from __future__ import annotations

import inspect
import typing
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .core.catalog import OpSpec
from .core.devices import arg_key
from .core.envvars import read as read_env

__all__ = ["LIBRARY", "custom_op", "traceable"]

LIBRARY = "te_fl"
_MARKER_DTYPE = torch.bool
_NAMES = {"Tensor": torch.Tensor, "dtype": torch.dtype, "Optional": Optional, "Tuple": Tuple, "List": List,
          "int": int, "float": float, "bool": bool, "str": str}
_CUSTOM_OPS: Dict[str, Any] = {}
_LIBRARIES: List[Any] = []


def _library():
    """The ``torch.library.Library`` that defines the te_fl ops (made on first use, kept for the process)."""
    if not _LIBRARIES:
        _LIBRARIES.append(torch.library.Library(LIBRARY, "DEF"))
    return _LIBRARIES[0]


def _annotation(text: str, where: str) -> Any:
    try:
        return eval(text, {"__builtins__": {}}, _NAMES)  # noqa: S307 - the catalog's own annotation strings
    except Exception as exc:  # noqa: BLE001 - re-raised with the op's name
        raise TypeError(f"{where}: cannot read the annotation {text!r}: {exc}") from None


def _schema_type(hint: Any) -> Any:
    """The custom-op parameter type for a catalog annotation (tuples of ints travel as lists)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return List[args[0]]
    return hint


def _result_count(spec: OpSpec) -> int:
    """How many items the op returns (a tuple's length, else one)."""
    hint = _annotation(spec.signature.return_annotation, f"op {spec.name!r}, return")
    return len(typing.get_args(hint)) if typing.get_origin(hint) is tuple else 1


def _returned_count(spec: OpSpec) -> int:
    """How many tensors the custom op returns: one per result, at least two for an op that may write its
    arguments (a lone tensor would do, but Inductor 2.11-2.13 indexes the result of such an op once
    functionalized, which only a tuple survives; the extra one is a None marker, dropped by :func:`_decode`)."""
    count = _result_count(spec)
    return 2 if count == 1 and spec.mutates else count


def _prototype(spec: OpSpec) -> Optional[Callable]:
    """A function with the custom op's signature (every parameter annotated, returning a tuple of one
    tensor per result), or None when the stub is not fully annotated."""
    params = []
    for p in spec.signature.parameters.values():
        if p.annotation is p.empty:
            return None
        hint = _schema_type(_annotation(p.annotation, f"op {spec.name!r}, parameter {p.name!r}"))
        params.append(p.replace(annotation=hint, kind=p.POSITIONAL_OR_KEYWORD))
    if spec.signature.return_annotation is inspect.Signature.empty:
        return None

    def prototype(*args):
        raise NotImplementedError

    returns = Tuple[(torch.Tensor,) * _returned_count(spec)]
    prototype.__signature__ = inspect.Signature(params, return_annotation=returns)
    return prototype


def _marker(code: int, like: torch.Tensor, shape: Sequence[int] = ()) -> torch.Tensor:
    return torch.empty((0, code, *shape), dtype=_MARKER_DTYPE, device=like.device)


def _encode(result: Any, args: Sequence[Any], mutated: Sequence[int], like: torch.Tensor, returned: int) -> Tuple:
    """The op's result as the custom op returns it: ``returned`` new tensors, markers for None (also
    padding the tuple) and for views of the arguments it writes (``mutated``: their indices)."""
    items = result if isinstance(result, tuple) else (result,)
    out = []
    for item in items:
        if item is None:
            out.append(_marker(0, like))
            continue
        owner = next((i for i in mutated if args[i] is not None and torch._C._is_alias_of(item, args[i])), None)
        if owner is not None:
            out.append(_marker(owner + 1, like, item.shape))
        elif (not item.is_contiguous() or (item.storage_offset() * item.element_size()) % 16
              or any(torch._C._is_alias_of(item, e) for e in out)):
            # a custom op's results are separate buffers laid out as the fake's (the reference backend's):
            # Inductor takes them as given. Copied: results sharing one buffer or not 16-byte aligned (flagos
            # current_scale), and layouts of the backend's own (flagos writes block scales column-major)
            out.append(item.clone(memory_format=torch.contiguous_format))
        else:
            out.append(item)
    return tuple(out) + (_marker(0, like),) * (returned - len(out))


def _decode(result: Any, args: Sequence[Any], single: bool) -> Any:
    """The catalog's result from what the custom op returned (markers read from their static shapes:
    [0, 0] is None, [0, i + 1, *shape] the view ``args[i].view(shape)``)."""
    items = []
    for t in result:
        if t.dtype == _MARKER_DTYPE and t.dim() >= 2 and t.shape[0] == 0:
            code = t.shape[1]
            items.append(None if code == 0 else args[code - 1].view(t.shape[2:]))
        else:
            items.append(t)
    return items[0] if single else tuple(items)  # single: the rest is padding


def custom_op(spec: OpSpec, run: Callable, fake: Callable) -> Optional[Tuple[Any, Optional[Any]]]:
    """(``torch.ops.te_fl.<name>``, its twin without the optional arguments it writes or None) for ``spec``
    (registered once per process), or None when its stub is not annotated.

    Args:
        spec: the op's declaration.
        run: the eager implementation (the default manager's dispatcher).
        fake: the implementation run on fake tensors (the reference backend's).
    """
    if spec.name in _CUSTOM_OPS:
        return _CUSTOM_OPS[spec.name]
    prototype = _prototype(spec)
    if prototype is None:
        _CUSTOM_OPS[spec.name] = None
        return None
    tuples = [i for i, p in enumerate(prototype.__signature__.parameters.values()) if typing.get_origin(p.annotation) is list
              and typing.get_args(p.annotation)[0] is int]
    key = spec.key_index
    mutated = [list(spec.signature.parameters).index(name) for name in spec.mutates]
    returned = _returned_count(spec)

    def encoded(impl: Callable, dropped: Tuple[str, ...] = ()) -> Callable:
        """``impl`` as a custom op calls it: lists back to tuples, the result encoded; ``dropped``: parameters
        the custom op lacks (passed to ``impl`` as None)."""
        def call(args: tuple):
            if tuples:  # the custom op took them as lists
                args = tuple(tuple(a) if i in tuples else a for i, a in enumerate(args))
            return _encode(impl(*args), args, mutated, args[key], returned)

        return _with_signature(spec, "call", "return _call(({args},))", dropped, _call=call)

    def register(name: str, dropped: Tuple[str, ...] = ()):
        writes = tuple(n for n in spec.mutates if n not in dropped)
        schema = torch.library.infer_schema(_without(prototype, dropped), mutates_args=writes)
        _library().define(name + schema)
        # one kernel for every device, called by the dispatcher directly (torch.library.custom_op would wrap
        # it in Python autograd and view-tracking layers: tens of microseconds per call); the ops run inside
        # the module Functions and compiled graphs, where autograd does not look into them
        _library().impl(name, encoded(run, dropped), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{LIBRARY}::{name}", encoded(fake, dropped), lib=_library())
        return getattr(getattr(torch.ops, LIBRARY), name).default

    # an optional argument the op writes gets a second custom op without it, used when it is None (the
    # common case: no amax_out, no out): torch 2.11 cannot trace a None given for a written argument
    optional = _optional_writes(spec)
    ops = (register(spec.name), register(f"{spec.name}_without_{'_'.join(optional)}", optional) if optional else None)
    _CUSTOM_OPS[spec.name] = ops
    return ops


def _optional_writes(spec: OpSpec) -> Tuple[str, ...]:
    """The arguments the op writes that may be None (``amax_out``, ``out``)."""
    return tuple(n for n in spec.mutates if spec.signature.parameters[n].default is None)


def _without(prototype: Callable, dropped: Tuple[str, ...]) -> Callable:
    """``prototype`` with the parameters ``dropped`` removed."""
    if not dropped:
        return prototype
    sig = prototype.__signature__

    def smaller(*args):
        raise NotImplementedError

    smaller.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name not in dropped])
    return smaller


def _with_signature(spec: OpSpec, name: str, body: str, dropped: Tuple[str, ...] = (), **namespace) -> Callable:
    """A function ``name`` with the op's parameters (and defaults) but ``dropped`` whose body is ``body``,
    formatted with ``{args}`` = every parameter name in order (None for the dropped ones); ``namespace``
    holds the globals the body reads."""
    params = list(spec.signature.parameters.values())
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    header = ", ".join(f"{p.name}=_defaults[{p.name!r}]" if p.name in defaults else p.name for p in params if p.name not in dropped)
    args = ", ".join("None" if p.name in dropped else p.name for p in params)
    source = f"def {name}({header}):\n    " + body.format(args=args).replace("\n", "\n    ")
    namespace = dict(namespace, _defaults=defaults)
    exec(compile(source, f"<te-fl {name} of {spec.name}>", "exec"), namespace)  # noqa: S102 - generated above
    return namespace[name]


_COMPILED_FORM_BODY = """if _is_compiling():
    for _te_supports, _te_fn in _compiled_form({key}):
        if _te_supports is None or _te_supports({args}):
            return _te_fn({args})
"""
_CUSTOM_OP_BODY = """    if {none_check}:
        return _decode(_op_without({without}), ({args},), _single)
    return _decode(_op({args}), ({args},), _single)
"""
_DISPATCH_BODY = "return _dispatch({args})"


_FORMS = SimpleNamespace()  # the compiled forms handed to traces: attribute "f<i>" is the i-th distinct one
_FORM_NAMES: Dict[tuple, str] = {}


def _compiled_form_of(compiled_form: Callable) -> Callable:
    """``form(key_argument)``: ``compiled_form(ArgKey)`` (see :meth:`OpManager.compiled_form`) for a tensor
    key argument, () for other keys and under ``TE_FL_COMPILE_OPS=custom_op``.

    Dynamo evaluates the choice as a constant of the trace (no guard, no graph node). A constant cannot
    be a function, so it is the name of the form's attribute of ``_FORMS``, read after the choice (an
    attribute added during a trace is read fresh; an item appended to a list Dynamo already read is not)."""
    def name_of(device: torch.device, dtype: torch.dtype) -> str:
        mode = read_env("TE_FL_COMPILE_OPS") or "traced"
        if mode not in ("traced", "custom_op"):
            raise ValueError(f"TE_FL_COMPILE_OPS={mode!r}: use 'traced' (the default) or 'custom_op'")
        chain = compiled_form(arg_key(SimpleNamespace(device=device, dtype=dtype))) if mode == "traced" else ()
        if chain not in _FORM_NAMES:
            _FORM_NAMES[chain] = f"f{len(_FORM_NAMES)}"
            setattr(_FORMS, _FORM_NAMES[chain], chain)
        return _FORM_NAMES[chain]

    # what torch._dynamo.assume_constant_result sets, without importing Dynamo (over a second) for eager users
    name_of._dynamo_marked_constant = True

    def form(key: Any) -> tuple:
        if not isinstance(key, torch.Tensor):
            return ()
        name = name_of(key.device, key.dtype)
        return getattr(_FORMS, name)

    return form


def traceable(spec: OpSpec, dispatcher: Callable, fake: Callable, compiled_form: Callable) -> Callable:
    """``dispatcher`` when ``spec`` has no custom op and is not ``traced``, else a function with the op's signature
    that calls ``dispatcher`` eagerly and, while ``torch.compile`` traces it, the op's compiled form
    (``compiled_form(ArgKey)``, see :meth:`OpManager.compiled_form`) or else its custom op (an op ``traced``
    without one: the dispatcher, where the graph ends)."""
    ops = custom_op(spec, dispatcher, fake)
    if ops is None and not spec.traced:
        return dispatcher
    head = _COMPILED_FORM_BODY.format(args="{args}", key=spec.key_param)
    if ops is None:
        body, custom = head + _DISPATCH_BODY, {}
    else:
        optional = _optional_writes(spec)
        body = head + _CUSTOM_OP_BODY.format(
            none_check=" and ".join(f"{n} is None" for n in optional) or "False",
            without=", ".join(n for n in spec.signature.parameters if n not in optional), args="{args}") + _DISPATCH_BODY
        single = typing.get_origin(_annotation(spec.signature.return_annotation, spec.name)) is not tuple
        custom = dict(_decode=_decode, _op=ops[0], _op_without=ops[1], _single=single)
    fn = _with_signature(spec, spec.name, body, _is_compiling=torch.compiler.is_compiling, _dispatch=dispatcher,
                         _compiled_form=_compiled_form_of(compiled_form), **custom)
    fn.__doc__, fn.__signature__, fn.__wrapped__ = dispatcher.__doc__, spec.signature, dispatcher
    for attr in ("spec", "traced"):
        if hasattr(dispatcher, attr):
            setattr(fn, attr, getattr(dispatcher, attr))
    return fn
