"""GEMM throughput of a linear layer's three products: the ``gemm`` op (FP8 and bf16) vs raw PyTorch.

Shape M = N = K = 8192 by default (PERF.md's Linear row). For each GEMM of a linear layer with
x [M, K], W [N, K], dy [M, N]:
    fprop  y  = x W^T    gemm(x, W, trans_b=True)    (cuBLASLt's TN layout as is)
    dgrad  dx = dy W     gemm(dy, W)                 (W needs a column-major copy)
    wgrad  dW = dy^T x   gemm(dy, x, trans_a=True)   (dy and x need transposed copies)
rows compare ``ops.gemm`` (dispatch; ``--backend`` pins its preferred kind) and the vendor backend
alone against the raw call on operands already in the layout the library wants (torch._scaled_mm
for FP8 E4M3 x E4M3 / E5M2 x E4M3 with per-tensor scales, torch.mm for bf16): the gap is the
dispatch overhead plus the copies. FLOPs = 2 M N K; TFLOP/s = FLOPs / median time. Accumulation
follows TE's defaults: fast for fprop, split (exact) for dgrad and wgrad.

The module rows time ``te.Linear(K, N)`` (bias on) fwd+bwd on x [M, K] in bf16 and under FP8 delayed
scaling (HYBRID, history 16): everything the layer does (casts with their transposes, amax records,
the scale update, bias gradient) against the three raw GEMMs of its dtype run as one step and timed
alike (PERF.md: >= 0.95x of the raw rate), each step waited for and back to back; the "CUDA graph"
rows time the same module captured by ``te.make_graphed_callables`` (no host launch overhead).

The "fp8 block" rows do the same for Float8BlockScaling: raw ``torch._scaled_mm`` with cuBLASLt's block
scales (x, dy in 1 x 128 tiles along each GEMM's K, W in 128 x 128), ``ops.gemm_blockwise``, and
``te.Linear`` under ``Float8BlockScaling()``.

    python benchmarks/bench_linear.py --json linear.json
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from _harness import backend_policy, base_parser, fwd_bwd_step, print_table, time_back_to_back, time_fn, write_json

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Product:
    """One GEMM of the layer: which operands, transposes and accumulation."""

    name: str
    operands: Tuple[str, str]
    trans_a: bool
    trans_b: bool
    split_accumulator: bool


PRODUCTS = (
    Product("fprop", ("x", "w"), trans_a=False, trans_b=True, split_accumulator=False),
    Product("dgrad", ("dy", "w"), trans_a=False, trans_b=False, split_accumulator=True),
    Product("wgrad", ("dy", "x"), trans_a=True, trans_b=False, split_accumulator=True),
)


def _tensors(m: int, n: int, k: int, fp8: bool) -> Dict[str, Tuple[torch.Tensor, object]]:
    """x, w (E4M3) and dy (E5M2) with their scale_inv, or bf16 ones (scale_inv None)."""
    shapes = {"x": ((m, k), E4M3), "w": ((n, k), E4M3), "dy": ((m, n), E5M2)}
    out = {}
    for name, (shape, fp8_dtype) in shapes.items():
        hp = torch.randn(shape, device="cuda")
        if not fp8:
            out[name] = (hp.to(torch.bfloat16), None)
            continue
        scale = torch.finfo(fp8_dtype).max / hp.abs().max()
        out[name] = ((hp * scale).to(fp8_dtype), (1.0 / scale).reshape(1).float())
    return out


def _op_call(impl_id, product: Product, tensors, backend: str) -> Callable[[], object]:
    """``gemm`` through the dispatcher (impl_id None) or on one backend."""
    from transformer_engine.plugin import ops
    from transformer_engine.plugin.core import get_default_manager

    (a, a_si), (b, b_si) = (tensors[name] for name in product.operands)
    args = (a, b, None, a_si, b_si, product.trans_a, product.trans_b, torch.bfloat16)
    kwargs = dict(use_split_accumulator=product.split_accumulator)
    if impl_id is not None:
        manager = get_default_manager()
        return lambda: manager.call_impl("gemm", impl_id, *args, **kwargs)

    def call():
        with backend_policy(backend):
            return ops.gemm(*args, **kwargs)

    return call


def _raw_call(product: Product, tensors) -> Callable[[], object]:
    """The raw PyTorch GEMM on operands prepared once in cuBLASLt's layout (row-major op(a),
    column-major op(b)): the ceiling the op is measured against."""
    (a, a_si), (b, b_si) = (tensors[name] for name in product.operands)
    mat1 = (a.t() if product.trans_a else a).contiguous()
    mat2 = (b.t() if product.trans_b else b).t().contiguous().t()
    if a_si is None:
        return lambda: torch.mm(mat1, mat2)
    return lambda: torch._scaled_mm(mat1, mat2, scale_a=a_si, scale_b=b_si, out_dtype=torch.bfloat16,
                                    use_fast_accum=not product.split_accumulator)


def _rows(args, fp8: bool) -> Tuple[List[dict], List[Callable[[], object]]]:
    """The three GEMMs' rows, and their raw calls (what ``_module_rows`` runs as one raw step)."""
    m, n, k = args.m, args.n, args.k
    tensors = _tensors(m, n, k, fp8)
    flops = 2.0 * m * n * k
    rows, raws = [], []
    for product in PRODUCTS:
        raws.append(_raw_call(product, tensors))
        providers = {"raw": raws[-1], "ops.gemm": _op_call(None, product, tensors, args.backend),
                     "vendor.cuda": _op_call("vendor.cuda", product, tensors, args.backend)}
        raw_ms = None
        for name, fn in providers.items():
            try:
                ms = time_fn(fn, warmup=args.warmup, iters=args.iters)
            except Exception as exc:  # noqa: BLE001 - one failing provider must not hide the others
                rows.append({"dtype": "fp8" if fp8 else "bf16", "gemm": product.name, "provider": name,
                             "error": f"{type(exc).__name__}: {exc}"[:120]})
                continue
            raw_ms = raw_ms or ms
            rows.append({"dtype": "fp8" if fp8 else "bf16", "gemm": product.name, "provider": name, "ms": ms,
                         "tflops": flops / ms / 1e9, "vs_raw": raw_ms / ms})
    return rows, raws


# Float8BlockScaling's three GEMMs as D = A @ B^T, each operand [rows, K] row-major quantized along K.
BLOCK_PRODUCTS = (
    ("fprop", ("m", "k"), ("n", "k"), (1, 128), (128, 128)),  # x, W
    ("dgrad", ("m", "n"), ("k", "n"), (1, 128), (128, 128)),  # dy, W^T
    ("wgrad", ("n", "m"), ("k", "m"), (1, 128), (1, 128)),    # dy^T, x^T
)


def _block_operand(rows: int, cols: int, block) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 [rows, cols] and positive float32 tile scales in cuBLASLt's layout (1 x 128: column-major)."""
    data = torch.randn(rows, cols, device="cuda").to(E4M3)
    tiles = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.rand(tiles[::-1], device="cuda").t() if block[0] == 1 else torch.rand(tiles, device="cuda")
    return data, scale_inv + 0.5


def _block_rows(args) -> Tuple[List[dict], List[Callable[[], object]]]:
    """Raw block-scaled ``torch._scaled_mm`` and ``ops.gemm_blockwise`` for the three GEMMs, and the raw calls."""
    from transformer_engine.plugin import ops

    dims = {"m": args.m, "n": args.n, "k": args.k}
    rows, raws = [], []
    for name, a_shape, b_shape, a_block, b_block in BLOCK_PRODUCTS:
        (a, sa), (b, sb) = _block_operand(*(dims[d] for d in a_shape), a_block), _block_operand(*(dims[d] for d in b_shape), b_block)
        raws.append(lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16))
        providers = {
            "raw": raws[-1],
            "ops.gemm_blockwise": lambda: ops.gemm_blockwise(a, b, sa, sb, a_block, b_block, torch.bfloat16),
        }
        raw_ms = None
        for provider, fn in providers.items():
            try:
                with backend_policy(args.backend):
                    ms = time_fn(fn, warmup=args.warmup, iters=args.iters)
            except Exception as exc:  # noqa: BLE001 - one failing provider must not hide the others
                rows.append({"dtype": "fp8 block", "gemm": name, "provider": provider, "error": f"{type(exc).__name__}: {exc}"[:120]})
                continue
            raw_ms = raw_ms or ms
            rows.append({"dtype": "fp8 block", "gemm": name, "provider": provider, "ms": ms,
                         "tflops": 2.0 * args.m * args.n * args.k / ms / 1e9, "vs_raw": raw_ms / ms})
    return rows, raws


def _raw_step(calls: List[Callable[[], object]]) -> Callable[[], None]:
    """The three raw GEMMs of one dtype called in turn: the module's GEMM work alone, timed as the module is."""

    def step():
        for call in calls:
            call()

    return step


def _module_rows(args, raw_calls: Dict[str, List[Callable[[], object]]]) -> List[dict]:
    """te.Linear fwd+bwd in bf16 and FP8 against the three raw GEMMs of its dtype run as one step.

    Both sides are timed alike, twice: each step waited for (``time_fn``), and back to back
    (``time_back_to_back``: the GPU never idles between steps, as in training). Under sustained FP8
    GEMMs the H200 reaches its power limit and lowers its clocks, so GEMMs timed one by one (the
    GEMM rows above) run faster than the same GEMMs in a longer step: the ratio to their sum
    (``vs_raw_sum``) mixes the two conditions and is kept for comparison with earlier runs only.
    """
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    m, n, k = args.m, args.n, args.k
    fp8 = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    eager = contextlib.nullcontext
    variants = [  # (dtype, row name, autocast of the eager step, make_graphed_callables arguments or None)
        ("bf16", "te.Linear fwd+bwd", eager, None),
        ("fp8", "te.Linear fwd+bwd", lambda: te.autocast(recipe=fp8), None),
        ("fp8 block", "te.Linear fwd+bwd", lambda: te.autocast(recipe=recipe.Float8BlockScaling()), None),
        ("bf16", "te.Linear fwd+bwd, CUDA graph", eager, {}),
        ("fp8", "te.Linear fwd+bwd, CUDA graph", eager, dict(enabled=True, recipe=fp8)),
    ]
    raw = {}  # dtype -> (ms waited for, ms back to back) of the raw step
    for dtype, calls in raw_calls.items():
        step = _raw_step(calls)
        raw[dtype] = (time_fn(step, warmup=args.warmup, iters=args.iters), time_back_to_back(step, warmup=args.warmup, iters=args.iters))
    out = []
    for dtype, name, ctx, graph in variants:
        layer = te.Linear(k, n, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        with backend_policy(args.backend):
            if graph is not None:
                layer = te.make_graphed_callables(layer, (x,), **graph)
            step = fwd_bwd_step(layer, x, dy, ctx)
            ms = time_fn(step, warmup=args.warmup, iters=args.iters)
            steady = time_back_to_back(step, warmup=args.warmup, iters=args.iters)
        raw_ms, raw_steady = raw[dtype]
        out.append({"dtype": dtype, "gemm": name, "provider": "module", "ms": ms, "tflops": 3 * 2.0 * m * n * k / ms / 1e9,
                    "vs_raw": raw_ms / ms, "raw_step_ms": raw_ms, "ms_back_to_back": steady,
                    "raw_step_ms_back_to_back": raw_steady, "vs_raw_back_to_back": raw_steady / steady})
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_linear needs a CUDA GPU")
    rows, raw_calls = [], {}
    for dtype, (dtype_rows, raws) in (("fp8", _rows(args, fp8=True)), ("bf16", _rows(args, fp8=False)), ("fp8 block", _block_rows(args))):
        rows += dtype_rows
        raw_calls[dtype] = raws
    for row in _module_rows(args, raw_calls):
        separate = [r["ms"] for r in rows if r["dtype"] == row["dtype"] and r["provider"] == "raw" and "ms" in r]
        row["vs_raw_sum"] = sum(separate) / row["ms"]
        rows.append(row)
    print_table(
        f"linear GEMMs M={args.m} N={args.n} K={args.k} (backend pin: {args.backend}); vs raw = raw time / this time "
        "(module rows: the three raw GEMMs as one step, timed alike; b2b = steps back to back)",
        ["dtype", "gemm", "provider", "ms", "TFLOP/s", "vs raw", "b2b ms", "vs raw b2b", "vs sum of GEMM rows"],
        [[r["dtype"], r["gemm"], r["provider"],
          *((f"{r['ms']:.3f}", f"{r['tflops']:.0f}", f"{r['vs_raw']:.3f}") if "ms" in r else (r["error"], "-", "-")),
          *((f"{r['ms_back_to_back']:.3f}", f"{r['vs_raw_back_to_back']:.3f}",
             f"{r['vs_raw_sum']:.3f}") if "ms_back_to_back" in r else ("-", "-", "-"))]
         for r in rows],
    )
    write_json(args.json, {"benchmark": "linear_gemm", "shape": {"m": args.m, "n": args.n, "k": args.k}, "results": rows})


if __name__ == "__main__":
    main()
