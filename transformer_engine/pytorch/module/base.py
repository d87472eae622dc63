"""``TransformerEngineBaseModule``: what every TE module shares.

- parameters: created in one place with an init function each; ``device=None`` means the current
  CUDA device if there is one, else the CPU (NVIDIA TE insists on CUDA); ``device="meta"`` defers
  initialization until :meth:`reset_parameters`;
- forward checks, before any work: input type and dtype (outside ``torch.autocast`` it must equal the
  parameter dtype), feature size, and under FP8 TE's shape rule (product of the leading dims % 8 == 0,
  last dim % 16 == 0, for the input and each weight);
- quantization: ``fp8_meta`` / ``quantizers`` (TE's names) kept in line with the active autocast, the
  quantizers of each forward call, and the quantized-weight cache of ``is_first_microbatch``;
- FP8 parameters: under ``quantized_model_init`` each GEMM weight is stored as a ``Float8Tensor`` and
  used as the fprop operand as it is (see :mod:`._fp8_params`; a branch decided at construction, so
  other modules pay nothing per call);
- checkpoints: ``_extra_state`` carries the delayed-scaling state without pickle (see
  :mod:`.._functions.extra_state`);
- tensor parallelism (:mod:`..parallel`): the settings in ``self.parallel``, the communication each
  forward hands its Function (:meth:`_comm`), sharded parameters initialized as the unsharded model's.

NaN / inf inputs under FP8: the amax is taken over the finite elements only, so one bad value never
poisons the amax history and the scale stays finite; inf saturates to +-fp8_max in the cast and NaN
stays NaN, so it propagates to the output as it would in high precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.plugin import ops, runs_as_aten

from ..quantization.autocast import current_config, forward_amax_buffer, register_states
from ..quantization.model_init import model_init_config
from ..quantization.quantizer import IDENTITY, Quantizer
from ..quantization.recipe_state import reserve_delayed_tensors, reserved_fit
from ..quantization.roles import BWD_ROLES, FWD_ROLES, Role, slot
from ..tensor.quantized_tensor import QuantizedTensor
from ..parallel.linear_comm import NO_COMM, LinearComm, linear_comm, share_scales
from ..parallel.tensor_parallel import ParallelConfig, initialize
from .._functions import extra_state
from .._functions.common import Operand
from ._fp8_params import fp8_param_operand, quantize_param, weight_param_quantizer
from ._public_quantizers import public_quantizers
from .._functions.fp8_meta import ForwardQuantization, GemmQuantizers, ensure_states, high_precision, new_fp8_meta
from .._functions.gemm import WgradTarget
from .._functions.wgrad_store import WeightGradStore

#: the two directions of a module's scaling state and the tensor roles of each
_MODE_ROLES = (("forward", FWD_ROLES), ("backward", BWD_ROLES))

__all__ = [
    "ParallelConfig", "TransformerEngineBaseModule", "check_fp8_shape", "check_unsupported", "default_device", "first_microbatch",
    "resolve_params_dtype", "te_outputs",
]

#: the ``is_first_microbatch`` of modules called without one (None: no weight cache), see :func:`first_microbatch`
_DEFAULT_FIRST_MICROBATCH: List[Optional[bool]] = [None]

#: weights of at most this many elements keep the W^T of forward's one-pass cast for backward (at most 4 MiB of FP8
#: each): casting W^T again in backward saves that memory but costs the host two more launches per weight and step
#: (the scale's copy and the second cast), which decide the step time of layers this small (docs/performance.md)
KEEP_WEIGHT_T_MAX_NUMEL = 1 << 22


@contextlib.contextmanager
def first_microbatch(value: Optional[bool]) -> Iterator[None]:
    """Inside, TE modules called without ``is_first_microbatch`` behave as if given ``value``: True casts
    the FP8 weights and caches them, False reuses the cache. ``make_graphed_callables(cache_quantized_params=True)``
    captures its graphs so (the graphed callable takes the argument; the modules it calls need not)."""
    saved, _DEFAULT_FIRST_MICROBATCH[0] = _DEFAULT_FIRST_MICROBATCH[0], value
    try:
        yield
    finally:
        _DEFAULT_FIRST_MICROBATCH[0] = saved


def default_device(device=None) -> torch.device:
    """``device`` as a torch.device; None means the current CUDA device if there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_fp8_shape(what: str, shape: Sequence[int]) -> None:
    """TE's FP8 GEMM shape rule: prod(shape[:-1]) % 8 == 0 and shape[-1] % 16 == 0; ValueError otherwise."""
    lead, last = math.prod(shape[:-1]), shape[-1]
    if lead % 8 or last % 16:
        raise ValueError(
            f"FP8 execution requires the product of all dimensions but the last to be divisible by 8 and the last "
            f"dimension to be divisible by 16; the {what} has shape {tuple(shape)} (product {lead}, last {last}). "
            "Pad it, or run this layer outside autocast(enabled=True)"
        )


def check_unsupported(**flags) -> None:
    """NotImplementedError for each TE option given a value we cannot honour yet."""
    for name, value in flags.items():
        if value:
            raise NotImplementedError(f"{name}={value!r} is not implemented yet in TransformerEngine-FL; leave it at its default")


def check_saved_input(module_name: str, quantizer: Quantizer) -> None:
    """``save_original_input``: backward casts x^T from x again, which gives forward's operand only where the cast
    depends on x alone.

    Raises:
        ValueError: an FP8 input cast that reads the step's scaling state (DelayedScaling).
    """
    if quantizer.is_fp8 and not quantizer.casts_from_input_alone:
        raise ValueError(
            f"{module_name}(save_original_input=True) needs an input cast that depends on the input alone (current "
            "scaling, block scaling, MXFP8, NVFP4): under DelayedScaling backward would cast x^T with the scale the "
            "step's update has changed (NVIDIA TE refuses it too); use save_original_input=False"
        )


def resolve_params_dtype(params_dtype: Optional[torch.dtype], dtype: Optional[torch.dtype]) -> torch.dtype:
    """``params_dtype`` or its alias ``dtype`` (not both), default ``torch.get_default_dtype()``."""
    if params_dtype is not None and dtype is not None and params_dtype != dtype:
        raise ValueError(f"params_dtype={params_dtype} and dtype={dtype} disagree; pass only one")
    return params_dtype or dtype or torch.get_default_dtype()


def _named_shape(what: str, tensor: torch.Tensor) -> Tuple[str, torch.Size]:
    """(what, tensor.shape): an operand as :func:`check_fp8_shape` takes it."""
    return what, tensor.shape


def te_outputs(result, bias, return_bias: bool, return_layernorm_output: bool):
    """TE's return convention: out, then bias if asked, then ln_out if asked (a bare tensor when alone); ``result`` is
    out, or (out, ln_out) with ``return_layernorm_output``."""
    if not return_layernorm_output:
        return (result, bias) if return_bias else result
    out, ln_out = result
    return (out, bias, ln_out) if return_bias else (out, ln_out)


class TransformerEngineBaseModule(torch.nn.Module):
    """Base of the TE modules (see the module docstring).

    Args:
        num_gemms: GEMMs per forward (Linear 1, LayerNormMLP 2, norms 0).
        get_rng_state_tracker: optional callable returning a tracker whose ``fork(name)`` context
            wraps parameter initialization.
        rng_tracker_name: name given to ``fork``.
        name: the module's name (TE's debug name).
    """

    def __init__(self, num_gemms: int, get_rng_state_tracker=None, rng_tracker_name: Optional[str] = None,
                 name: Optional[str] = None):
        super().__init__()
        ops.prepare_for_compile()  # every op traceable before torch.compile can meet one
        self.fp8_meta = new_fp8_meta(num_gemms)
        self._high_precision = high_precision(num_gemms)  # the quantization of a call outside FP8: made once
        self._reserved_states: Dict[str, Tuple[torch.Tensor, ...]] = {}  # see _reserve_states
        self._slot_quantizers: Dict[str, list] = {"scaling_fwd": [], "scaling_bwd": []}  # what the casts use, per slot
        self._public_quantizers: Optional[Dict[str, list]] = None  # see the quantizers property
        self.name = name
        self._param_init: Dict[str, Callable[[torch.Tensor], None]] = {}
        self._fp8_weight_gemms: Dict[str, int] = {}  # GEMM weight name -> its GEMM (stored in FP8 under quantized_model_init)
        self._weight_cache: Dict[str, object] = {}  # FP8 weight copies kept across microbatches (is_first_microbatch)
        self._fp8_gemms: Tuple[GemmQuantizers, ...] = ()  # self._slot_quantizers grouped per GEMM, see _states_installed
        self._rng = (get_rng_state_tracker, rng_tracker_name)
        init = model_init_config()
        self.primary_weights_in_fp8 = init.enabled
        self._model_init_recipe = init.recipe if init.enabled else None
        self._keep_init_val = init.enabled and init.preserve_high_precision_init_val
        self.wgrad_store = WeightGradStore(delay_wgrad_compute=False)  # see _delay_wgrads
        self.wgrad_accumulation_and_reduce_hooks: List[Callable[[], None]] = []

    # ----------------------------------------------------------------------------- parallel settings
    parallel = ParallelConfig()

    @property
    def tp_group(self):
        return self.parallel.tp_group

    @property
    def tp_size(self) -> int:
        return self.parallel.tp_size

    @tp_size.setter
    def tp_size(self, value: int) -> None:
        """TE keeps tp_size as a plain attribute, which clients set (Megatron-Core's wrappers, before calling
        the constructor with the same size); checked against the group as the constructor checks it."""
        self.parallel = dataclasses.replace(self.parallel, tp_size=value)

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel

    @property
    def parallel_mode(self) -> Optional[str]:
        return self.parallel.parallel_mode

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Set the tensor-parallel process group (TE's method), for a module built before its group existed.

        Raises:
            ValueError: the group's size differs from the module's ``tp_size``.
        """
        self.parallel = self.parallel.with_group(tp_group)

    def _comm(self, mode: Optional[str]) -> LinearComm:
        """The communication of this module's linear split by ``mode`` (none without tensor parallelism)."""
        return linear_comm(self.parallel, mode, type(self).__name__)

    # ----------------------------------------------------------------------------- parameters
    def _register(self, name: str, shape: Tuple[int, ...], init_fn: Callable, dtype: torch.dtype,
                  device: torch.device, data: Optional[torch.Tensor] = None, *, fp8_gemm: Optional[int] = None,
                  **attributes) -> torch.nn.Parameter:
        """Create parameter ``name`` (uninitialized, or on ``data``: e.g. a slice of a buffer it shares with
        other parameters) with its init function and extra attributes; ``fp8_gemm``: the GEMM whose weight
        it is (stored in FP8 under ``quantized_model_init``)."""
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device) if data is None else data)
        for key, value in attributes.items():
            setattr(param, key, value)
        self.register_parameter(name, param)
        self._param_init[name] = init_fn
        if fp8_gemm is not None:
            self._fp8_weight_gemms[name] = fp8_gemm
        return param

    def _rng_context(self):
        tracker, tracker_name = self._rng
        if tracker is None:
            return contextlib.nullcontext()
        return tracker().fork() if tracker_name is None else tracker().fork(tracker_name)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """(Re)initialize every parameter; parameters on "meta" are first materialized on :func:`default_device`."""
        if defer_init:
            return
        for name, init_fn in self._param_init.items():
            param = getattr(self, name)
            if param.device.type == "meta":
                param = self._materialize(name, param)
            in_fp8 = self.primary_weights_in_fp8 and name in self._fp8_weight_gemms
            values = _high_precision_like(param) if isinstance(param, QuantizedTensor) else param
            with torch.no_grad(), self._rng_context():
                initialize(values, init_fn, self.parallel)  # a sharded parameter: its shard of a full-size init
            if in_fp8:
                self._store_in_fp8(name, values)
        self._weight_cache.clear()
        self._reserve_states()

    def _store_in_fp8(self, name: str, values: torch.Tensor) -> None:
        """Parameter ``name`` := its initial ``values`` quantized with the weight quantizer of its GEMM under
        the ``quantized_model_init`` recipe (a new FP8 parameter, or re-quantized in place if it is one)."""
        recipe = self._model_init_recipe
        if ensure_states(self.fp8_meta, self._slot_quantizers, recipe, values.device, type(self).__name__, self._reserved_states):
            self._states_installed()
        index = slot(self._fp8_weight_gemms[name], Role.WEIGHT)
        param = getattr(self, name)
        if isinstance(param, QuantizedTensor):
            with torch.no_grad():
                param.copy_(values)
            if self._keep_init_val:
                param._high_precision_init_val = values.detach().to("cpu", copy=True)
            return
        quantizer = weight_param_quantizer(recipe, self._slot_quantizers["scaling_fwd"][index], self.fp8_meta, index)
        setattr(self, name, quantize_param(param, quantizer, preserve_init_val=self._keep_init_val))

    def _materialize(self, name: str, param: torch.nn.Parameter) -> torch.nn.Parameter:
        new = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=default_device()),
                                 requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)
        setattr(self, name, new)
        return new

    # ----------------------------------------------------------------------------- delayed weight gradients
    def _delay_wgrads(self, delay: bool, names: Iterable[str]) -> None:
        """TE's ``delay_wgrad_compute``: backward queues this module's wgrads for :meth:`backward_dw` (see
        :mod:`.._functions.wgrad_store`); its GEMM parameters ``names`` get ``skip_backward_post_hook`` (their gradients come later)."""
        self.wgrad_store = WeightGradStore(delay_wgrad_compute=delay)
        for name in names if delay else ():
            getattr(self, name).skip_backward_post_hook = True

    def _wgrad_target(self, dtype: torch.dtype, params: Sequence[torch.nn.Parameter]) -> WgradTarget:
        """Where the dW of the weight ``params`` goes: their ``main_grad`` with ``fuse_wgrad_accumulation``, through the
        delayed queue with ``delay_wgrad_compute``.

        Raises:
            NotImplementedError: delayed wgrads under torch.compile (the queue is Python state a compiled backward
                would not update).
        """
        delayed = self.wgrad_store if self.wgrad_store.delay_wgrad_compute() else None
        if delayed is not None and torch.compiler.is_compiling():
            raise NotImplementedError(f"{type(self).__name__}(delay_wgrad_compute=True) does not run under torch.compile; "
                                      "compile the model without it")
        params = tuple(params)
        return WgradTarget(dtype, params if self.fuse_wgrad_accumulation else (), delayed=delayed, params=params)

    def backward_dw(self) -> None:
        """Compute the weight gradients the oldest backward queued (``delay_wgrad_compute``), then call the hooks of
        :meth:`register_wgrad_accumulation_and_reduce_hooks`; nothing for a module that does not delay them.

        Raises:
            RuntimeError: no backward queued wgrads.
        """
        if not self.wgrad_store.delay_wgrad_compute():
            return
        self.wgrad_store.pop()
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    def register_wgrad_accumulation_and_reduce_hooks(self, wgrad_accumulation_and_reduce_hook: Callable[[], None]) -> None:
        """Call ``wgrad_accumulation_and_reduce_hook()`` after each :meth:`backward_dw` (TE's API, for Megatron-Core)."""
        self.wgrad_accumulation_and_reduce_hooks.append(wgrad_accumulation_and_reduce_hook)

    # ----------------------------------------------------------------------------- forward checks
    def _check_input(self, inp: torch.Tensor, param_dtype: torch.dtype, features: int, what: str = "in_features") -> torch.dtype:
        """Check the input before any work and return the compute dtype: torch.autocast's dtype when it is on, else the
        parameters' (which ``inp`` must have).

        Raises:
            TypeError: ``inp`` is not a floating-point tensor, or (outside torch.autocast) not of ``param_dtype``.
            ValueError: its last dimension is not ``features`` (named ``what`` in the message).
        """
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"{type(self).__name__} expects a torch.Tensor input, got {type(inp).__name__}")
        if not inp.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got dtype {inp.dtype}")
        if torch.is_autocast_enabled(inp.device.type):
            act_dtype = torch.get_autocast_dtype(inp.device.type)
        elif inp.dtype != param_dtype:
            raise TypeError(
                f"{type(self).__name__}: the input dtype {inp.dtype} differs from the parameter dtype {param_dtype}; "
                f"cast the input to {param_dtype}, convert the module with .to({inp.dtype}), or run under torch.autocast"
            )
        else:
            act_dtype = param_dtype
        if inp.dim() < 1 or inp.shape[-1] != features:
            raise ValueError(
                f"{type(self).__name__} expects the last dimension of its input to be {what}={features}, "
                f"got input shape {tuple(inp.shape)}"
            )
        return act_dtype

    #: the GEMM operands a linear forward checks under TE's FP8 shape rule, as the errors name them: the input, then the
    #: weight of each GEMM (see :meth:`_linear_prelude`)
    _FP8_OPERANDS: Tuple[str, ...] = ("input", "weight")
    #: the communication of each GEMM without tensor parallelism
    _NO_COMMS: Tuple[LinearComm, ...] = (NO_COMM,)

    def _gemm_comms(self) -> Tuple[LinearComm, ...]:
        """The tensor-parallel communication of each GEMM (a linear split by ``parallel_mode``; LayerNormMLP has two)."""
        return (self._comm(self.parallel.parallel_mode),)

    def _linear_prelude(self, operands: Tuple[torch.Tensor, ...], features: int, what: str = "in_features",
                        saved_input_of: Optional[str] = None) -> Tuple[torch.dtype, Tuple[LinearComm, ...], ForwardQuantization]:
        """What a linear module's forward does before its Function, in this order: the input checks (:meth:`_check_input`),
        each GEMM's communication (:meth:`_gemm_comms`), this call's quantization (:meth:`_prepare_quantization`, with TE's
        FP8 shape rule for ``operands``: the input, then each GEMM's weight), where the module keeps its input for backward
        (``saved_input_of``: its name) the check that the input's cast allows it (:func:`check_saved_input`), and the scale
        each GEMM's communication shares (``share_scales``; the weight quantizers stay as they are).

        Returns:
            (activation dtype, the comms in GEMM order, the quantization of this call with the shared scales).
        """
        inp = operands[0]
        act_dtype = self._check_input(inp, operands[1].dtype, features, what)
        split = self.parallel.tp_size > 1  # else no GEMM communicates (``linear_comm``), nor shares a scale
        comms = self._gemm_comms() if split else self._NO_COMMS
        q = self._prepare_quantization(inp.device, map(_named_shape, self._FP8_OPERANDS, operands))  # shapes read under FP8 only
        if saved_input_of is not None:
            check_saved_input(saved_input_of, q.gemms[0].input)
        return act_dtype, comms, share_scales(q, *comms) if split else q

    def _runs_as_torch_linear(self, inp: torch.Tensor, weights: Tuple[torch.Tensor, ...], act_dtype: torch.dtype,
                              q: ForwardQuantization, comms: Tuple[LinearComm, ...]) -> bool:
        """True when this call's GEMMs may run as ``torch.nn.functional.linear`` with PyTorch's autograd: no quantization
        (nor calibration), no tensor parallelism, dW into ``weight.grad`` now (no ``fuse_wgrad_accumulation``, no
        ``delay_wgrad_compute``), high-precision ``weights`` (each GEMM's), and a policy whose first choice for ``gemm`` on
        these operands is PyTorch's own matmul (``plugin.runs_as_aten``; a backend registered ahead of it keeps the
        Function)."""
        return (q is self._high_precision and comms is self._NO_COMMS and not self.fuse_wgrad_accumulation
                and not self.wgrad_store.delay_wgrad_compute() and not any(isinstance(w, QuantizedTensor) for w in weights)
                and runs_as_aten("gemm", inp.device, act_dtype))

    # ----------------------------------------------------------------------------- quantization
    def _check_recipe_match(self, recipe) -> None:
        built = self._model_init_recipe
        if built is not None and type(built) is not type(recipe):
            raise RuntimeError(
                f"Recipe mismatch for {type(self).__name__}: its weights were built under quantized_model_init with "
                f"{type(built).__name__}, but the autocast recipe is {type(recipe).__name__}"
            )

    def _prepare_quantization(self, device: torch.device, shapes: Iterable[Tuple[str, Sequence[int]]]) -> ForwardQuantization:
        """The quantizers of this forward call, with the checks that must pass first.

        Args:
            device: where the scaling state lives (the input's device).
            shapes: (what, shape) of every GEMM operand that the FP8 shape rule applies to.
        """
        config = current_config()
        n = self.fp8_meta["num_gemms"]
        if not config.active:
            return self._high_precision
        self._check_recipe_match(config.recipe)
        if config.enabled:
            for what, shape in shapes:
                check_fp8_shape(what, shape)
        if torch.compiler.is_compiling() and config.recipe.delayed() and self._lacks_states(config.recipe, device):
            torch.compiler.disable(self._build_states_eagerly)(config.recipe, device)  # (wrapped here: the decorator imports Dynamo)
        elif ensure_states(self.fp8_meta, self._slot_quantizers, config.recipe, device, type(self).__name__, self._reserved_states):
            self._states_installed()
        fwd_state, bwd_state = self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"]
        if not config.enabled:  # calibration: high precision, amaxes recorded
            observers = fwd_state.make_observers()
            return ForwardQuantization(GemmQuantizers.from_slots(observers, [IDENTITY] * bwd_state.num_quantizers, n))
        gemms = self._fp8_gemms
        if torch.compiler.is_compiling() and config.recipe.delayed():  # one kept scale copy per traced call
            gemms = GemmQuantizers.from_slots(fwd_state.traced_quantizers(forward_amax_buffer(fwd_state)),
                                              self._slot_quantizers["scaling_bwd"], n)
        return ForwardQuantization(
            gemms=gemms,
            split_accumulator=fwd_state.split_accumulator,
            backward_update=register_states(fwd_state, bwd_state),
            for_training=torch.is_grad_enabled(),
        )

    def _lacks_states(self, recipe, device: torch.device) -> bool:
        """True when this module has no scaling states of ``recipe``'s type yet, and no tensors reserved for
        them that fit ``recipe`` on ``device`` (:meth:`_reserve_states`)."""
        state = self.fp8_meta["scaling_fwd"]
        if state is not None and type(state.recipe) is type(recipe):
            return False
        n = self.fp8_meta["num_gemms"]
        return not all(reserved_fit(self._reserved_states.get(mode), recipe, n * len(roles), device) for mode, roles in _MODE_ROLES)

    def _reserve_states(self) -> None:
        """Allocate the delayed-scaling tensors (default history length) on the parameters' device now, so
        that a first FP8 step traced by torch.compile finds them as inputs and traces whole. A state of
        another history length (or device) is made when first needed, which costs one graph break."""
        n, device = self.fp8_meta["num_gemms"], self._state_device()
        if n == 0 or device.type == "meta" or self.fp8_meta["scaling_fwd"] is not None:
            return
        length = DelayedScaling.__dataclass_fields__["amax_history_len"].default
        self._reserved_states = {mode: reserve_delayed_tensors(n * len(roles), length, device) for mode, roles in _MODE_ROLES}

    def _build_states_eagerly(self, recipe, device: torch.device) -> None:
        """Delayed-scaling states made outside the graph that torch.compile traces (one graph break, on the
        first traced FP8 call of a module that never ran under this recipe's type). Tensors a graph made
        would be its outputs, and the grad casts write their amax histories in the backward graph, which
        AOTAutograd allows for graph inputs only; the next trace takes them as inputs. Code compiled with
        ``fullgraph=True`` must therefore run one eager FP8 step of the model first."""
        if ensure_states(self.fp8_meta, self._slot_quantizers, recipe, device, type(self).__name__, self._reserved_states):
            self._states_installed()

    def _states_installed(self) -> None:
        """After new scaling states and quantizers: forget the weights they cast, group the quantizers per GEMM
        (once here rather than per forward: the quantizers change only with the states)."""
        self._weight_cache.clear()
        slots = self._slot_quantizers
        self._fp8_gemms = GemmQuantizers.from_slots(slots["scaling_fwd"], slots["scaling_bwd"], self.fp8_meta["num_gemms"])
        self._public_quantizers = None  # made again on the next access of ``quantizers``

    @property
    def quantizers(self) -> Dict[str, list]:
        """TE's ``module.quantizers``: {"scaling_fwd": [...], "scaling_bwd": [...]}, each slot's quantizer as NVIDIA TE's
        public class, casting as the module does (see :mod:`._public_quantizers`). Made on the first access after
        the states' quantizers change, never on the forward path."""
        if self._public_quantizers is None:
            slots = self._slot_quantizers
            self._public_quantizers = {key: public_quantizers(self.fp8_meta, key, slots[key]) for key in slots}
        return self._public_quantizers

    def _weight_operand(self, key: str, weight: torch.Tensor, quantizer: Quantizer,
                        is_first_microbatch: Optional[bool]) -> Operand:
        """The weight as GEMM operand; FP8 copies are cached per TE's ``is_first_microbatch`` rule.

        None (unless :func:`first_microbatch` gives another default): quantize, no cache; with autograd
        on, W^T (the dgrad layout) is written in the same pass for a weight of at most
        ``KEEP_WEIGHT_T_MAX_NUMEL`` elements, and cast again from the weight in backward for a larger one
        (``quantize_weight``: no FP8 copy of W lives from forward to backward). True:
        quantize and cache. False: reuse the cache (the weight's amax is then not recorded), quantizing
        only if there is none yet. A cached copy carries W^T too, written in the same pass. Traced by
        torch.compile, W^T is cast in forward with W (as with a cache): a backward cast would read the
        scale that AOTAutograd's partitioner may take from the state after the forward's update.
        """
        if self.primary_weights_in_fp8 and isinstance(weight, QuantizedTensor):
            operand = fp8_param_operand(weight, quantizer)
            if operand is not None:
                return operand
            weight = weight._dequantize(weight.dtype)  # not an FP8 call, or not stored as the GEMM reads it: cast as usual
        if not quantizer.is_fp8:
            return quantizer.quantize(weight)
        if is_first_microbatch is None:
            is_first_microbatch = _DEFAULT_FIRST_MICROBATCH[0]
        if (is_first_microbatch is None and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and weight.numel() > KEEP_WEIGHT_T_MAX_NUMEL):
            return quantizer.quantize_weight(weight.detach())
        cached = self._weight_cache.get(key)
        if is_first_microbatch is False and cached is not None:
            return cached
        # detached, the cast records no autograd graph (cheaper than a no_grad context)
        operand = quantizer.quantize(weight.detach(), columnwise=torch.is_grad_enabled())
        if is_first_microbatch is not None:
            self._weight_cache[key] = operand
        return operand

    # ----------------------------------------------------------------------------- checkpoints
    #: the slot order of the checkpointed state: GEMM-major, or role-major as TE's GroupedLinear stores it
    _ROLE_MAJOR_CHECKPOINT = False

    def get_extra_state(self) -> torch.Tensor:
        """The delayed-scaling state as a uint8 tensor in TE's format (empty when there is none; see ``_extra_state``)."""
        return extra_state.save_states(self.fp8_meta, role_major=self._ROLE_MAJOR_CHECKPOINT)

    def set_extra_state(self, state) -> None:
        """Restore what :meth:`get_extra_state` (or NVIDIA TE's) saved (an empty tensor or None restores nothing).

        Raises:
            ValueError: for a payload that is not a checkpoint of scaling state (e.g. a pickle of other objects, which
                is not unpickled), another GEMM count, or a recipe type that differs from the module's.
        """
        if extra_state.load_states(state, self.fp8_meta, self._slot_quantizers, self._model_init_recipe or self.fp8_meta["recipe"],
                                   type(self).__name__, self._state_device(), role_major=self._ROLE_MAJOR_CHECKPOINT):
            self._states_installed()

    def _state_device(self) -> torch.device:
        devices = [p.device for p in self.parameters() if p.device.type != "meta"]
        return devices[0] if devices else default_device()


def _high_precision_like(param: QuantizedTensor) -> torch.Tensor:
    """An uninitialized plain tensor of ``param``'s nominal shape, dtype and device, with its public attributes
    (the tensor-parallel layout ``initialize`` reads): where a quantized parameter is initialized again."""
    values = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    for key, value in param.__dict__.items():
        if not key.startswith("_"):
            setattr(values, key, value)
    return values
