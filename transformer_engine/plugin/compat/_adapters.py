"""Adapters from upstream TE-FL op signatures onto this catalog's ops.

Upstream TE-FL names its ops after the pybind functions of NVIDIA TE (``rmsnorm_fwd(input, weight,
eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma) -> (y, None, rsigma)``). Where the
catalog op means the same thing, an :class:`Adapter` says how to build the upstream arguments from
the catalog's (``to_upstream``), how to turn the upstream result into the catalog's
(``from_upstream``), and which calls an upstream-style impl cannot serve (``decline``: FP8 outputs,
which upstream produces through TE quantizer objects this library does not build).

An upstream function is called the way its own signature allows (:class:`CallPlan`): parameters it
names are passed by position (or keyword), upstream parameters it does not name are left out when
their value is neutral (``None``, ``False``, ``0``, or something the adapter does itself, such as
the output cast) and otherwise the call is declined with the reason, so a ``**kwargs`` that would
swallow ``zero_centered_gamma=True`` never yields a wrong result.

Nothing here imports torch: tensors are handled through their methods.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["Adapter", "CallPlan", "ADAPTERS", "ALWAYS"]


def ALWAYS(value: Any) -> bool:  # noqa: N802 - a constant-like predicate
    """Neutral predicate of a parameter the adapter handles itself (an output dtype: the result is cast)."""
    return True


def _off(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0)


@dataclass(frozen=True)
class Adapter:
    """How one upstream op maps onto one catalog op.

    Attributes:
        upstream: upstream op name (the pybind name).
        ours: catalog op name.
        params: upstream parameters in upstream's positional order.
        required: how many leading ``params`` an upstream impl must accept (the data it works on).
        to_upstream: catalog arguments (bound, defaults applied) -> upstream values by name.
        from_upstream: (upstream result, catalog arguments) -> the catalog op's result.
        decline: catalog arguments -> why an upstream-style impl cannot serve them, or None.
        neutral: per upstream parameter, when its value may be left out for an impl that lacks it
            (default: ``None``, ``False`` or ``0``).
        result_from: the upstream argument the impl writes its result into (``compute_amax``'s
            ``amax``); ``from_upstream`` then receives that argument instead of the return value.
    """

    upstream: str
    ours: str
    params: Tuple[str, ...]
    required: int
    to_upstream: Callable[[Mapping[str, Any]], Dict[str, Any]]
    from_upstream: Callable[[Any, Mapping[str, Any]], Any]
    decline: Callable[[Mapping[str, Any]], Optional[str]] = lambda a: None
    neutral: Mapping[str, Callable[[Any], bool]] = field(default_factory=dict)
    result_from: Optional[str] = None

    def is_neutral(self, name: str, value: Any) -> bool:
        return self.neutral.get(name, _off)(value)


@dataclass(frozen=True)
class CallPlan:
    """How to call one upstream function: which upstream parameters go by position, by keyword, or not at all."""

    positional: Tuple[str, ...]
    keyword: Tuple[str, ...]
    dropped: Tuple[str, ...]

    @classmethod
    def for_function(cls, fn: Callable, adapter: Adapter) -> "CallPlan":
        """Plan the calls of ``fn``; ValueError when it cannot take the data the op needs."""
        sig = inspect.signature(fn)
        kinds = {p.name: p.kind for p in sig.parameters.values()}
        n_pos = sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds.values())
        varargs = inspect.Parameter.VAR_POSITIONAL in kinds.values()
        positional, keyword, dropped = [], [], []
        for i, name in enumerate(adapter.params):
            if i < n_pos or varargs:
                (positional if not keyword and not dropped else keyword).append(name)
            elif kinds.get(name) is inspect.Parameter.KEYWORD_ONLY:
                keyword.append(name)
            else:
                dropped.append(name)
        taken = set(positional) | set(keyword)
        missing = [n for n in adapter.params[: adapter.required] if n not in taken]
        if missing:
            raise ValueError(f"its signature {sig} takes no {', '.join(missing)} (upstream {adapter.upstream} passes "
                             f"{', '.join(adapter.params[: adapter.required])} first)")
        return cls(tuple(positional), tuple(keyword), tuple(dropped))

    def blocked(self, adapter: Adapter, values: Mapping[str, Any], fn_name: str) -> Optional[str]:
        """Why this call cannot go to the function (a non-neutral value for a parameter it lacks), or None."""
        for name in self.dropped:
            if not adapter.is_neutral(name, values[name]):
                return (f"upstream-style impl {fn_name} takes no {name!r} parameter, so it cannot serve "
                        f"{name}={values[name]!r}")
        return None

    def call(self, fn: Callable, values: Mapping[str, Any]) -> Any:
        return fn(*(values[n] for n in self.positional), **{n: values[n] for n in self.keyword})


# -- result helpers --------------------------------------------------------------------------------
def _first(result: Any) -> Any:
    return result[0] if isinstance(result, (tuple, list)) else result


def _cast(t: Any, dtype: Any) -> Any:
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


def _rows(t: Any) -> Any:
    """Per-row statistics as this catalog keeps them: float32, one per row ([M])."""
    return None if t is None else t.reshape(-1).float()


def _is_fp8(t: Any) -> bool:
    return t is not None and "float8" in str(getattr(t, "dtype", ""))


_FP8_OUT = ("FP8 output (fp8_scale given): upstream-style impls quantize through TE quantizer objects, "
            "which TE-FL does not build; the next backend serves this call")


def _norm_decline(a: Mapping[str, Any]) -> Optional[str]:
    return _FP8_OUT if a["fp8_scale"] is not None or a["amax_out"] is not None else None


# -- normalization ---------------------------------------------------------------------------------
def _rms_fwd_result(r: Any, a: Mapping[str, Any]) -> Tuple:
    y, rsigma = (r[0], r[2]) if len(r) >= 3 else (r[0], r[1])  # pybind (y, None, rsigma) or README (y, rsigma)
    return _cast(y, a["out_dtype"] or a["x"].dtype), _rows(rsigma), None, None


def _ln_fwd_result(r: Any, a: Mapping[str, Any]) -> Tuple:
    return _cast(r[0], a["out_dtype"] or a["x"].dtype), _rows(r[1]), _rows(r[2]), None, None


_NORM_NEUTRAL = {"otype": ALWAYS, "eps": ALWAYS}

_NORMS = (
    Adapter("rmsnorm_fwd", "rmsnorm_fwd",
            ("input", "weight", "eps", "ln_out", "quantizer", "otype", "sm_margin", "zero_centered_gamma"), 2,
            lambda a: dict(input=a["x"], weight=a["weight"], eps=a["eps"], ln_out=None, quantizer=None,
                           otype=a["out_dtype"] or a["x"].dtype, sm_margin=0, zero_centered_gamma=a["zero_centered_gamma"]),
            _rms_fwd_result, _norm_decline, {"otype": ALWAYS}),
    Adapter("layernorm_fwd", "layernorm_fwd",
            ("input", "weight", "bias", "eps", "ln_out", "quantizer", "otype", "sm_margin", "zero_centered_gamma"), 3,
            lambda a: dict(input=a["x"], weight=a["weight"], bias=a["bias"], eps=a["eps"], ln_out=None, quantizer=None,
                           otype=a["out_dtype"] or a["x"].dtype, sm_margin=0, zero_centered_gamma=a["zero_centered_gamma"]),
            _ln_fwd_result, _norm_decline, {"otype": ALWAYS}),
    Adapter("rmsnorm_bwd", "rmsnorm_bwd",
            ("dy", "x", "rsigma", "gamma", "sm_margin", "zero_centered_gamma", "eps"), 4,
            lambda a: dict(dy=a["dy"], x=a["x"], rsigma=a["rstd"].reshape(a["x"].shape[:-1]), gamma=a["weight"],
                           sm_margin=0, zero_centered_gamma=a["zero_centered_gamma"], eps=1e-5),
            lambda r, a: (_cast(r[0], a["x"].dtype), _cast(r[1], a["weight"].dtype)), neutral=_NORM_NEUTRAL),
    Adapter("layernorm_bwd", "layernorm_bwd",
            ("dy", "x", "mu", "rsigma", "gamma", "sm_margin", "zero_centered_gamma"), 5,
            lambda a: dict(dy=a["dy"], x=a["x"], mu=a["mean"].reshape(a["x"].shape[:-1]),
                           rsigma=a["rstd"].reshape(a["x"].shape[:-1]), gamma=a["weight"], sm_margin=0,
                           zero_centered_gamma=a["zero_centered_gamma"]),
            lambda r, a: (_cast(r[0], a["x"].dtype), _cast(r[1], a["weight"].dtype), _cast(r[2], a["weight"].dtype))),
)


# -- activations -----------------------------------------------------------------------------------
_ACT_NAMES = ("gelu", "geglu", "qgelu", "qgeglu", "relu", "reglu", "srelu", "sreglu", "silu", "swiglu", "glu")
_CLAMP_NEUTRAL = {"limit": lambda v: v == 7.0, "alpha": lambda v: v == 1.702}


def _act(name: str) -> Adapter:
    return Adapter(name, name, ("input", "quantizer"), 1, lambda a: dict(input=a["x"], quantizer=None),
                   lambda r, a: _cast(_first(r), a["x"].dtype))


def _dact(name: str) -> Adapter:
    return Adapter("d" + name, "d" + name, ("grad", "fwd_input", "quantizer"), 2,
                   lambda a: dict(grad=a["dy"], fwd_input=a["x"], quantizer=None),
                   lambda r, a: _cast(_first(r), a["x"].dtype))


_ACTIVATIONS = tuple(_act(n) for n in _ACT_NAMES) + tuple(_dact(n) for n in _ACT_NAMES) + (
    Adapter("clamped_swiglu", "clamped_swiglu", ("input", "quantizer", "limit", "alpha"), 1,
            lambda a: dict(input=a["x"], quantizer=None, limit=a["limit"], alpha=a["alpha"]),
            lambda r, a: _cast(_first(r), a["x"].dtype), neutral=_CLAMP_NEUTRAL),
    Adapter("clamped_dswiglu", "clamped_dswiglu", ("grad", "fwd_input", "quantizer", "limit", "alpha"), 2,
            lambda a: dict(grad=a["dy"], fwd_input=a["x"], quantizer=None, limit=a["limit"], alpha=a["alpha"]),
            lambda r, a: _cast(_first(r), a["x"].dtype), neutral=_CLAMP_NEUTRAL),
)


# -- softmax: same arguments, upstream names -------------------------------------------------------
def _softmax(name: str) -> Adapter:
    if name.endswith("_backward"):
        return Adapter(name, name, ("output_grad", "softmax_output", "scale"), 3,
                       lambda a: dict(output_grad=a["dy"], softmax_output=a["y"], scale=a["scale"]), lambda r, a: r)
    if name.startswith("scaled_masked"):
        return Adapter(name, name, ("input", "mask", "scale"), 3,
                       lambda a: dict(input=a["x"], mask=a["mask"], scale=a["scale"]), lambda r, a: r)
    return Adapter(name, name, ("input", "scale"), 2, lambda a: dict(input=a["x"], scale=a["scale"]), lambda r, a: r)


_SOFTMAX = tuple(
    _softmax(f"scaled_{kind}softmax_{way}")
    for kind in ("", "masked_", "upper_triang_masked_", "aligned_causal_masked_")
    for way in ("forward", "backward")
)


# -- optimizers: same positional arguments ---------------------------------------------------------
def _same(name: str, params: Tuple[str, ...], ours: Tuple[str, ...]) -> Adapter:
    return Adapter(name, name, params, len(params), lambda a: {u: a[o] for u, o in zip(params, ours)}, lambda r, a: r)


_MT = ("chunk_size", "noop_flag", "tensor_lists")
_OPTIMIZERS = (
    _same("multi_tensor_scale", _MT + ("scale",), _MT + ("scale",)),
    Adapter("multi_tensor_l2norm", "multi_tensor_l2norm", _MT + ("per_tensor",), 3,
            lambda a: dict(chunk_size=a["chunk_size"], noop_flag=a["noop_flag"], tensor_lists=a["tensor_lists"],
                           per_tensor=a["per_tensor"]), lambda r, a: r),
    _same("multi_tensor_adam", _MT + ("lr", "beta1", "beta2", "eps", "step", "mode", "bias_correction", "weight_decay"),
          _MT + ("lr", "beta1", "beta2", "epsilon", "step", "mode", "bias_correction", "weight_decay")),
    _same("multi_tensor_sgd", _MT + ("wd", "momentum", "dampening", "lr", "nesterov", "first_run", "wd_after_momentum", "scale"),
          _MT + ("weight_decay", "momentum", "dampening", "lr", "nesterov", "first_run", "wd_after_momentum", "scale")),
)


# -- gemm and amax ---------------------------------------------------------------------------------
def _gemm_upstream(a: Mapping[str, Any]) -> Dict[str, Any]:
    # TE's generic_gemm is column-major: row-major D = op(B) @ op(A)^T-style, so ours (a, b) is (B, A)
    bias = a["bias"]
    return dict(A=a["b"], transA=a["trans_b"], B=a["a"], transB=a["trans_a"], D=a["out"], quantizer=None,
                output_dtype=a["out_dtype"] or a["a"].dtype, bias=bias, bias_type=None if bias is None else bias.dtype,
                gelu=False, gelu_in=None, grad=False, workspace=None, workspace_size=0,
                accumulate=a["accumulate"], use_split_accumulator=a["use_split_accumulator"])


def _gemm_result(r: Any, a: Mapping[str, Any]) -> Any:
    d = _cast(_first(r), a["out_dtype"] or a["a"].dtype)
    out = a["out"]
    if out is not None and d is not out:
        out.copy_(d)
        return out
    return d


def _gemm_decline(a: Mapping[str, Any]) -> Optional[str]:
    if a["a_scale_inv"] is not None or a["b_scale_inv"] is not None or _is_fp8(a["a"]) or _is_fp8(a["b"]):
        return ("FP8 operands: upstream's generic_gemm takes TE Float8Tensor objects, which TE-FL does not build; "
                "the next backend serves this call")
    return None


def _amax_call(a: Mapping[str, Any]) -> Dict[str, Any]:
    return dict(input=a["x"], amax=a["x"].float().new_zeros((1,)))


_OTHER = (
    Adapter("generic_gemm", "gemm",
            ("A", "transA", "B", "transB", "D", "quantizer", "output_dtype", "bias", "bias_type", "gelu", "gelu_in",
             "grad", "workspace", "workspace_size", "accumulate", "use_split_accumulator"), 4,
            _gemm_upstream, _gemm_result, _gemm_decline,
            {"output_dtype": ALWAYS, "bias_type": ALWAYS, "workspace": ALWAYS, "workspace_size": ALWAYS,
             "use_split_accumulator": ALWAYS}),
    Adapter("compute_amax", "compute_amax", ("input", "amax"), 2, _amax_call,
            lambda amax, a: amax.reshape(()), result_from="amax"),
)


ADAPTERS: Dict[str, Adapter] = {ad.upstream: ad for ad in _NORMS + _ACTIVATIONS + _SOFTMAX + _OPTIMIZERS + _OTHER}
"""Upstream op name -> its adapter onto the catalog."""
