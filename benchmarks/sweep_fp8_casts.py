"""Launch configurations of the flagos FP8 cast kernels (quantize, cast_transpose and its q_t-only and dbias forms,
fp8_transpose, blockwise), swept on the GPU.

Each kernel is timed inside a CUDA graph (``triton.testing.do_bench_cudagraph``), so host launch cost
is left out and the table shows what the kernel itself reaches, as a fraction of the measured
device-to-device copy bandwidth. The flagos launchers use the best row of this table.

The blockwise section (quantize_blockwise 1 x 128 and cast_transpose_blockwise 128, E4M3, power-of-two
scales) checks each config once against the reference backend, bit for bit, before timing it; its
labels name the constants of flagos/quantization.py and quantization_blockwise.py that select the config (``_COL_TILE`` stands for
``_CT_BLOCKWISE_COL_TILE`` and so on; NOT BIT-EXACT rows are not timed). A split row times both of its
launches: the shipped 1 x 128 quantize and the column kernel.

    python benchmarks/sweep_fp8_casts.py --json sweep.json
    python benchmarks/sweep_fp8_casts.py --kernels blockwise
"""

from __future__ import annotations

import itertools

import torch
import triton
from triton.testing import do_bench_cudagraph

from _harness import base_parser, print_table, write_json
from bench_kernels import copy_bandwidth

from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.flagos import quantization_blockwise as fb
from transformer_engine.plugin.backends.flagos._common import fp8_format
from transformer_engine.plugin.backends.reference import quantization as ref

E4M3 = torch.float8_e4m3fn
KERNELS = ("quantize", "cast_transpose", "quantize_transposed", "cast_transpose_dbias", "fp8_transpose", "blockwise")
B = 128  # block length of the blockwise section (Float8BlockScaling)


def _fmt():
    return fp8_format(E4M3).constexprs(hw_cast=True)


def sweep_quantize(x, scale, q, scale_inv, amax):
    n = x.numel()
    for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        def run(block=block, warps=warps):
            fq._quantize_kernel[(triton.cdiv(n, block),)](x, q, scale, scale_inv, amax, n, BLOCK=block, WRITE_Q=True,
                                                           num_warps=warps, **_fmt())
        yield f"BLOCK={block} warps={warps}", run


def sweep_cast_transpose(x, scale, q, q_t, scale_inv, amax, write_q=True, dbias=False):
    """Tile configs of ``_cast_transpose_kernel``: cast_transpose, its q_t-only form (quantize_transposed,
    ``write_q`` False) or its dbias form (column sums of each tile into float32 partials)."""
    m, n = x.shape
    for (bm, bn), warps in itertools.product(((32, 32), (64, 64), (64, 128), (128, 64), (128, 128)), (2, 4, 8)):
        partials = torch.empty(triton.cdiv(m, bm), n, device="cuda") if dbias else None

        def run(bm=bm, bn=bn, warps=warps, partials=partials):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            fq._cast_transpose_kernel[grid](x, q, q_t, scale, scale_inv, amax, partials, m, n, x.stride(0),
                                            BLOCK_M=bm, BLOCK_N=bn, DBIAS=dbias, WRITE_Q=write_q, WRITE_QT=True,
                                            num_warps=warps, **_fmt())
        yield f"tile={bm}x{bn} warps={warps}", run


def sweep_transpose(q, q_t):
    m, n = q.shape
    for (bm, bn), warps in itertools.product(((32, 32), (64, 64), (64, 128), (128, 64), (128, 128)), (2, 4, 8)):
        def run(bm=bm, bn=bn, warps=warps):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            fq._transpose_kernel[grid](q, q_t, m, n, q.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        yield f"tile={bm}x{bn} warps={warps}", run


def sweep_quantize_blockwise(x, q, s):
    """1 x 128 quantize: (_BLOCKWISE_ROW, _BLOCKWISE_ROW_TILE, warps); q uint8 [M, N], s float32 [N / 128, M]."""
    m, n = x.shape
    configs = [(128, 2048, 4), (128, 4096, 4), (128, 4096, 8), (128, 8192, 4), (128, 8192, 8), (128, 16384, 8),
               (256, 8192, 4), (512, 8192, 4), (512, 16384, 8), (1024, 16384, 8)]
    for cols, elements, warps in configs:
        def run(cols=cols, block_m=elements // cols, warps=warps):
            fb._quantize_blockwise_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, cols),)](
                x, q, s, m, n, x.stride(0), 0, BLOCK_M=block_m, GROUPS=cols // B, B=B, SQUARE=False, TRANSPOSED=False, POW2=True,
                num_warps=warps, **_fmt())
        label = (f"_BLOCKWISE_ROW={cols} _BLOCKWISE_ROW_TILE={elements} "
                 f"_BLOCKWISE_ROW_PER_THREAD={elements // (32 * warps)} ({warps} warps)")
        yield label, run


def sweep_cast_transpose_blockwise(x, q, s, q_t, s_t, columns_only=False):
    """cast_transpose 128: (SPLIT, columns per tile, warps, programs per SM); storage s [N / 128, M], s_t [M / 128, N].

    Split: fb.quantize_blockwise's kernel (its shipped settings) for (q, s), then the column kernel
    over [128, COL_TILE] tiles for (q_t, s_t); fused: one kernel over [128, TILE_N] tiles for all four.
    Programs per SM: the persistent grid (None: one program per tile). ``columns_only``: the split
    configs' column kernel alone (q, s untouched).
    """
    m, n = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    configs = [(True, c, w, p) for c, w, p in itertools.product((32, 64), (2, 4), (None, 2, 3, 4))]
    configs += [(True, 128, 4, p) for p in (None, 2)]
    configs += [] if columns_only else [(False, 128, 4, None)] + [(False, 128, 8, p) for p in (None, 1, 2)]
    for split, tile_n, warps, programs in configs:
        tiles = triton.cdiv(m, B) * triton.cdiv(n, tile_n)
        grid = (tiles if programs is None else min(tiles, programs * sms),)

        def run(split=split, tile_n=tile_n, warps=warps, grid=grid):
            if split and not columns_only:  # the 1 x 128 quantize as cast_transpose_blockwise launches it
                fb._launch_quantize_blockwise(x, q.view(E4M3), s.t(), square=False, block_len=B, power_2_scale=True, eps_bits=0)
            fb._cast_transpose_blockwise_kernel[grid](
                x, q, s, q_t, s_t, s_t, m, n, x.stride(0), 0, TILE_N=tile_n, B=B, ROWS=not split, DBIAS=False, TRANSPOSE_CODES=True,
                POW2=True, num_warps=warps, **_fmt())
        mode = f"_SPLIT=True _COL_TILE={tile_n}" if split else f"_SPLIT=False _TILE_N={tile_n}"
        place = "one program per tile" if programs is None else f"_PROGRAMS_PER_SM={programs}"
        yield f"_CT_BLOCKWISE{mode} _PER_THREAD={B * tile_n // (32 * warps)} ({warps} warps) {place}", run


def _blockwise_cases(x):
    """(name, bytes moved, configs, check) of the blockwise section.

    check = (outputs, same): the outputs are poisoned before a config's first run, then same() is True
    when they match the reference bit for bit.
    """
    m, n = x.shape
    u8 = dict(device="cuda", dtype=torch.uint8)
    q, q_t = torch.empty(m, n, **u8), torch.empty(n, m, **u8)
    s, s_t = torch.empty(n // B, m, device="cuda"), torch.empty(m // B, n, device="cuda")
    q_ref, s_ref = ref.quantize_blockwise(x, E4M3, 1, B, power_2_scale=True, amax_epsilon=0.0)
    qt_ref, st_ref = ref.quantize_blockwise(x.t(), E4M3, 1, B, power_2_scale=True, amax_epsilon=0.0)
    same = lambda codes, scales, c_ref, s_ref: torch.equal(codes, c_ref.view(torch.uint8)) and torch.equal(scales.t(), s_ref)  # noqa: E731
    return [
        ("quantize_blockwise(1x128)", 3 * m * n + 4 * m * n // B, sweep_quantize_blockwise(x, q, s),
         ((q, s), lambda: same(q, s, q_ref, s_ref))),
        ("cast_transpose_blockwise(128)", 4 * m * n + 8 * m * n // B, sweep_cast_transpose_blockwise(x, q, s, q_t, s_t),
         ((q, s, q_t, s_t), lambda: same(q, s, q_ref, s_ref) and same(q_t, s_t, qt_ref, st_ref))),
        ("cast_transpose_blockwise(128) column kernel", 3 * m * n + 4 * m * n // B,
         sweep_cast_transpose_blockwise(x, q, s, q_t, s_t, columns_only=True),
         ((q_t, s_t), lambda: same(q_t, s_t, qt_ref, st_ref))),
    ]


def _classic_cases(x):
    """(name, bytes moved, configs, check) of the per-tensor casts (no check: their tests cover every config)."""
    m, n = x.shape
    scale = torch.tensor([4.0], device="cuda")
    q = torch.empty(m, n, device="cuda", dtype=torch.uint8)
    q_t = torch.empty(n, m, device="cuda", dtype=torch.uint8)
    scale_inv = torch.empty((), device="cuda")
    amax = torch.zeros((), device="cuda", dtype=torch.int32)
    return [
        ("quantize", 3 * m * n, sweep_quantize(x, scale, q, scale_inv, amax), None),
        ("cast_transpose", 4 * m * n, sweep_cast_transpose(x, scale, q, q_t, scale_inv, amax), None),
        ("quantize_transposed", 3 * m * n, sweep_cast_transpose(x, scale, q, q_t, scale_inv, amax, write_q=False), None),
        ("cast_transpose_dbias", 4 * m * n, sweep_cast_transpose(x, scale, q, q_t, scale_inv, amax, dbias=True), None),
        ("fp8_transpose", 2 * m * n, sweep_transpose(q, q_t), None),
    ]


def _ops_whole(x):
    """The shipped op of each section, launcher included."""
    scale = torch.tensor([4.0], device="cuda")
    q = torch.zeros(x.shape, device="cuda", dtype=torch.uint8).view(E4M3)
    return {
        "quantize": lambda: fq.quantize(x, scale, E4M3),
        "cast_transpose": lambda: fq.cast_transpose(x, scale, E4M3),
        "quantize_transposed": lambda: fq.quantize_transposed(x, scale, E4M3),
        "cast_transpose_dbias": lambda: fq.cast_transpose_dbias(x, scale, E4M3),
        "fp8_transpose": lambda: fq.fp8_transpose(q),
        "quantize_blockwise(1x128)": lambda: fb.quantize_blockwise(x, E4M3, 1, B, power_2_scale=True, amax_epsilon=0.0),
        "cast_transpose_blockwise(128)": lambda: fb.cast_transpose_blockwise(x, E4M3, B, power_2_scale=True, amax_epsilon=0.0),
    }


def _time_configs(name, shape, nbytes, configs, check, copy):
    """One result row per config (timed, or the compile error / NOT BIT-EXACT), in the sweep's JSON form."""
    for label, run in configs:
        row = {"kernel": name, "shape": shape, "config": label}
        try:
            if check is not None:
                outputs, same = check
                for t in outputs:
                    t.fill_(0x7F if t.dtype == torch.uint8 else float("nan"))
                run()
                if not same():
                    yield {**row, "error": "NOT BIT-EXACT"}
                    continue
            ms = do_bench_cudagraph(run)
        except Exception as exc:  # a config the compiler rejects (registers, shared memory)
            yield {**row, "error": str(exc)[:80]}
            continue
        yield {**row, "us": ms * 1e3, "of_copy": nbytes / (ms * 1e-3) / copy}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x4096,8192x16384", help="MxN,... (multiples of 128)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated sections of {KERNELS}")
    args = parser.parse_args()
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels {','.join(unknown)}: choose among {','.join(KERNELS)}")
    copy = copy_bandwidth() * 1e9  # bytes/s
    results = []
    for shape in args.shapes.split(","):
        m, n = map(int, shape.split("x"))
        x = (torch.randn(m, n, device="cuda") * torch.exp(2 * torch.randn(m, n, device="cuda"))).to(torch.bfloat16)
        cases = [c for c in _classic_cases(x) if c[0] in kernels]
        cases += _blockwise_cases(x) if "blockwise" in kernels else []
        ops_whole = _ops_whole(x)
        for name, nbytes, configs, check in cases:
            results.extend(_time_configs(name, shape, nbytes, configs, check, copy))
            if name not in ops_whole:  # a part of an op (the column kernel): no shipped op of its own
                continue
            ms = do_bench_cudagraph(ops_whole[name])
            results.append({"kernel": name, "shape": shape, "config": "the op as shipped (launcher included)",
                            "us": ms * 1e3, "of_copy": nbytes / (ms * 1e-3) / copy})
    rows = [[r["kernel"], r["shape"], r["config"], f"{r['us']:.1f}" if "us" in r else "n/a",
             f"{r['of_copy']:.2f}" if "of_copy" in r else r.get("error", "")] for r in results]
    print_table(f"FP8 cast kernels in CUDA graphs (copy bandwidth {copy / 1e12:.2f} TB/s)",
                ["kernel", "shape", "config", "us", "of copy"], rows)
    write_json(args.json, {"copy_bytes_per_s": copy, "results": results})


if __name__ == "__main__":
    main()
