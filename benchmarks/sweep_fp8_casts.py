"""Launch configurations of the flagos FP8 cast kernels (quantize, cast_transpose, fp8_transpose), swept on the GPU.

Each kernel is timed inside a CUDA graph (``triton.testing.do_bench_cudagraph``), so host launch cost
is left out and the table shows what the kernel itself reaches, as a fraction of the measured
device-to-device copy bandwidth. The flagos launchers use the best row of this table.

    python benchmarks/sweep_fp8_casts.py --json sweep.json
"""

from __future__ import annotations

import itertools

import torch
import triton
from triton.testing import do_bench_cudagraph

from _harness import base_parser, print_table, write_json
from bench_kernels import copy_bandwidth

from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.flagos._common import fp8_format

E4M3 = torch.float8_e4m3fn


def _fmt():
    return fp8_format(E4M3).constexprs(True)


def sweep_quantize(x, scale, q, scale_inv, amax):
    n = x.numel()
    for block, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8, 16)):
        def run(block=block, warps=warps):
            fq._quantize_kernel[(triton.cdiv(n, block),)](x, q, scale, scale_inv, amax, n, BLOCK=block, WRITE_Q=True,
                                                           num_warps=warps, **_fmt())
        yield f"BLOCK={block} warps={warps}", run


def sweep_cast_transpose(x, scale, q, q_t, scale_inv, amax):
    m, n = x.shape
    for (bm, bn), warps in itertools.product(((32, 32), (64, 64), (64, 128), (128, 64), (128, 128)), (2, 4, 8)):
        def run(bm=bm, bn=bn, warps=warps):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            fq._cast_transpose_kernel[grid](x, q, q_t, scale, scale_inv, amax, None, m, n, x.stride(0),
                                            BLOCK_M=bm, BLOCK_N=bn, DBIAS=False, WRITE_QT=True,
                                            num_warps=warps, **_fmt())
        yield f"tile={bm}x{bn} warps={warps}", run


def sweep_transpose(q, q_t):
    m, n = q.shape
    for (bm, bn), warps in itertools.product(((32, 32), (64, 64), (64, 128), (128, 64), (128, 128)), (2, 4, 8)):
        def run(bm=bm, bn=bn, warps=warps):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
            fq._transpose_kernel[grid](q, q_t, m, n, q.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        yield f"tile={bm}x{bn} warps={warps}", run


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x4096,8192x16384")
    args = parser.parse_args()
    copy = copy_bandwidth() * 1e9  # bytes/s
    results = []
    for shape in args.shapes.split(","):
        m, n = map(int, shape.split("x"))
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([4.0], device="cuda")
        q = torch.empty(m, n, device="cuda", dtype=torch.uint8)
        q_t = torch.empty(n, m, device="cuda", dtype=torch.uint8)
        scale_inv = torch.empty((), device="cuda")
        amax = torch.zeros((), device="cuda", dtype=torch.int32)
        cases = [
            ("quantize", 3 * m * n, sweep_quantize(x, scale, q, scale_inv, amax)),
            ("cast_transpose", 4 * m * n, sweep_cast_transpose(x, scale, q, q_t, scale_inv, amax)),
            ("fp8_transpose", 2 * m * n, sweep_transpose(q, q_t)),
        ]
        ops_whole = {
            "quantize": lambda: fq.quantize(x, scale, E4M3),
            "cast_transpose": lambda: fq.cast_transpose(x, scale, E4M3),
            "fp8_transpose": lambda: fq.fp8_transpose(q.view(E4M3)),
        }
        for name, nbytes, configs in cases:
            for label, run in configs:
                try:
                    ms = do_bench_cudagraph(run)
                except Exception as exc:  # a config the compiler rejects (registers, shared memory)
                    results.append({"kernel": name, "shape": shape, "config": label, "error": str(exc)[:80]})
                    continue
                results.append({"kernel": name, "shape": shape, "config": label, "us": ms * 1e3,
                                "of_copy": nbytes / (ms * 1e-3) / copy})
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
