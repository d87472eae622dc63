"""Compile every flagos Triton kernel for sm_90 (H100 / H200) without a GPU and report what the GPU runs.

The flagos launchers are called at the shapes of ``benchmarks/bench_kernels.py`` with tensors on
PyTorch's ``meta`` device (nothing is allocated or computed). Each kernel launch is captured
instead of run: Triton's own argument binder specializes it as it would on the GPU (dtypes,
16-byte alignment, integers divisible by 16), ``triton.compile`` builds it for
``GPUTarget("cuda", 90, 32)`` with the launch's num_warps / num_stages, the bundled ``ptxas -v``
counts registers and spills, and the bundled ``cuobjdump -sass`` gives the machine code. Launchers
see an sm_90 device with 132 SMs (the H200's): the hardware FP8 cast and H200-sized persistent grids.

Columns of the table, one row per compiled kernel of each case (autotuned kernels: every config):

    regs       registers per thread;  spill  bytes spilled (stores + loads, 0 is the goal)
    smem       shared memory per program (bytes)
    occ        programs resident per SM (limited by registers, 64 warps, 32 blocks, 228 KB smem)
    grid       programs launched at that shape (1-D grids: "1056 = 1.0 w" = waves of resident programs)
    ldg / stg  global loads / stores per thread as count x bytes (16 = 128-bit vectors)
    in flight  LDGs (and bytes) a thread has issued when it first waits for one: its memory-level
               parallelism (ptxas may issue a second load only after the first one's data is used)
    atom       global atomics (ATOMG: waits for the old value; RED: fire-and-forget)
    fence      MEMBAR / CCTL / ERRBAR (an acq_rel atomic brings a MEMBAR.ALL.GPU and an L1 flush)
    f2fp       packed fp32 -> fp8 conversions (F2FP.SATFINITE.E4M3/E5M2, 2 values each)
    async      LDGSTS (cp.async) instructions: the software pipeline of a loop's loads
    mma        tensor-core instructions: HGMMA / QGMMA (Hopper wgmma) or HMMA (the older, slower path)
    sass       instructions in the listing (straight-line kernels execute about this many per thread)

Usage (from the repository root; needs triton, no GPU)::

    python scripts/compile_check.py                       # every family
    python scripts/compile_check.py --only quant,norm     # substrings of case names
    python scripts/compile_check.py --dump /tmp/sass      # also write <n>.<case>.<kernel>.ptx / .sass
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple
from unittest import mock

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from transformer_engine.plugin.backends.flagos._launch import CachedLaunch  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SM_COUNT = 132  # H200 SXM
_REGS_PER_SM, _MAX_WARPS_PER_SM, _MAX_BLOCKS_PER_SM = 65536, 64, 32
_SMEM_PER_SM, _SMEM_RESERVED_PER_BLOCK = 228 * 1024, 1024
_FLAGOS = "transformer_engine.plugin.backends.flagos"
META = torch.device("meta")


@dataclass
class Launch:
    """One captured kernel launch: the kernel, its bound arguments and launch options."""

    case: str
    fn: JITFunction
    args: tuple
    kwargs: dict
    grid: object  # a tuple, or a callable of the bound arguments (autotuned kernels)


@dataclass
class Report:
    """What ptxas and the SASS say about one compiled kernel."""

    case: str
    kernel: str
    warps: int
    stages: int
    grid: tuple
    regs: int = 0
    spill: int = 0
    smem: int = 0
    sass: Dict[str, collections.Counter] = field(default_factory=dict)
    in_flight: Tuple[int, int] = (0, 0)
    instructions: int = 0
    error: str = ""


# -- capturing launches -------------------------------------------------------------------------


class _Recorder:
    """Replaces JITFunction.run / Autotuner.run: records launches (every config of an autotuner)."""

    def __init__(self):
        self.case = ""
        self.launches: List[Launch] = []

    def jit_run(self, fn, *args, grid, warmup, **kwargs):
        self.launches.append(Launch(self.case, fn, args, kwargs, grid))

    def autotune_run(self, tuner, *args, grid, warmup, **kwargs):
        for config in tuner.configs:
            self.launches.append(Launch(self.case, tuner.fn, args, dict(kwargs, **config.all_kwargs()), grid))


def _h200_programs(device, per_sm: int = 2) -> int:
    return per_sm * SM_COUNT


@contextlib.contextmanager
def _capturing(recorder: _Recorder):
    """Launches are recorded, and flagos launchers see an sm_90 GPU with the H200's SM count."""

    def jit_run(fn, *args, grid, warmup, **kwargs):
        recorder.jit_run(fn, *args, grid=grid, warmup=warmup, **kwargs)

    patches = [
        mock.patch.object(JITFunction, "run", jit_run),
        mock.patch.object(Autotuner, "run", lambda tuner, *a, **k: recorder.autotune_run(tuner, *a, **k)),
        # cached launches go through Triton's own path, the one recorded here (theirs asks the absent driver)
        mock.patch.object(CachedLaunch, "__getitem__", lambda launcher, grid: launcher.fn[grid]),
    ]
    for family in ("activation", "attention", "misc", "normalization", "optimizer", "quantization", "rope", "softmax"):
        module = importlib.import_module(f"{_FLAGOS}.{family}")
        if hasattr(module, "hw_fp8_cast"):
            patches.append(mock.patch.object(module, "hw_fp8_cast", lambda device: True))
        if hasattr(module, "num_programs_hint"):
            patches.append(mock.patch.object(module, "num_programs_hint", _h200_programs))
        if hasattr(module, "_feature_gap"):  # attention declines devices other than cuda, meta included
            patches.append(mock.patch.object(module, "_feature_gap", lambda *args, **kwargs: None))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


# -- the cases: flagos launchers at bench_kernels.py's shapes --------------------------------------


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device=META)


def _norm_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import normalization as n

    m, h, e4m3 = 16384, 4096, torch.float8_e4m3fn
    x, w, stat, scale = _t(m, h), _t(h), _t(m, dtype=torch.float32), _t(1, dtype=torch.float32)
    return {
        "layernorm_fwd": lambda: n.layernorm_fwd(x, w, w, 1e-5),
        "layernorm_fwd+fp8": lambda: n.layernorm_fwd(x, w, w, 1e-5, zero_centered_gamma=False, fp8_scale=scale, fp8_dtype=e4m3),
        "rmsnorm_fwd+fp8 e5m2": lambda: n.rmsnorm_fwd(x, w, 1e-5, zero_centered_gamma=True, fp8_scale=scale, fp8_dtype=torch.float8_e5m2),
        "layernorm_bwd": lambda: n.layernorm_bwd(x, x, stat, stat, w),
        "rmsnorm_bwd": lambda: n.rmsnorm_bwd(x, x, stat, w),
    }


def _activation_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import activation as a

    m, f, scale = 8192, 8192, _t(1, dtype=torch.float32)
    plain, gated, dy = _t(m, f), _t(m, 2 * f), _t(m, f)
    cases = {}
    for op, (_, is_gated) in a._OPS.items():
        x = gated if is_gated else plain
        backward = "clamped_dswiglu" if op == "clamped_swiglu" else "d" + op
        cases[op] = (lambda op=op, x=x: getattr(a, op)(x))
        cases[backward] = (lambda bwd=backward, x=x: getattr(a, bwd)(dy, x))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        name = f"activation_quantize(swiglu) {str(fp8)[-6:]}"
        cases[name] = lambda fp8=fp8: a.activation_quantize(gated, "swiglu", scale, fp8)
    cases["activation_quantize(gelu)"] = lambda: a.activation_quantize(plain, "gelu", scale, torch.float8_e4m3fn)
    return cases


def _quantization_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import quantization as q
    from transformer_engine.plugin.backends.flagos import quantization_blockwise as qb

    m, n = 16384, 4096
    x, scale = _t(m, n), _t(1, dtype=torch.float32)
    cases = {
        "compute_amax": lambda: q.compute_amax(x),
        "cast_transpose": lambda: q.cast_transpose(x, scale, torch.float8_e4m3fn),
        "fp8_transpose": lambda: q.fp8_transpose(_t(m, n, dtype=torch.float8_e4m3fn)),
        "quantize_blockwise(1x128)": lambda: qb.quantize_blockwise(x, torch.float8_e4m3fn, 1, 128, power_2_scale=True, amax_epsilon=0.0),
        "cast_transpose_blockwise(128)": lambda: qb.cast_transpose_blockwise(x, torch.float8_e4m3fn, 128, power_2_scale=True,
                                                                             amax_epsilon=0.0),
    }
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        cases[f"quantize {str(fp8)[-6:]}"] = lambda fp8=fp8: q.quantize(x, scale, fp8)
        cases[f"dequantize {str(fp8)[-6:]}"] = lambda fp8=fp8: q.dequantize(_t(m, n, dtype=fp8), scale, torch.bfloat16)
    return cases


def _softmax_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import softmax as s

    x, x3 = _t(4, 32, 1024, 1024), _t(128, 1024, 1024)
    mask = _t(4, 1, 1024, 1024, dtype=torch.bool)
    return {
        "scaled_softmax_forward": lambda: s.scaled_softmax_forward(x, 0.5),
        "scaled_masked_softmax_forward": lambda: s.scaled_masked_softmax_forward(x, mask, 0.5),
        "scaled_upper_triang_masked_softmax_forward": lambda: s.scaled_upper_triang_masked_softmax_forward(x3, 0.5),
        "scaled_aligned_causal_masked_softmax_forward": lambda: s.scaled_aligned_causal_masked_softmax_forward(x, 0.5),
        "scaled_softmax_backward": lambda: s.scaled_softmax_backward(x, x, 0.5),
    }


def _misc_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import misc, rope

    t, freqs = _t(4096, 4, 32, 128), _t(4096, 1, 1, 128, dtype=torch.float32)
    z, target, per_row = _t(8192, 32768), _t(8192, dtype=torch.int64), _t(8192, dtype=torch.float32)
    return {
        "fused_rope_forward": lambda: rope.fused_rope_forward(t, freqs),
        "fused_rope_forward interleaved": lambda: rope.fused_rope_forward(t, freqs, "sbhd", interleaved=True),
        "fused_rope_backward": lambda: rope.fused_rope_backward(t, freqs),
        "cross_entropy_fwd": lambda: misc.cross_entropy_fwd(z, target),
        "cross_entropy_bwd": lambda: misc.cross_entropy_bwd(per_row, z, target, per_row),
    }


def _optimizer_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import optimizer as o

    sizes = [(4096, 1024)] * 4 + [(4097,), (17,)]
    lists = [[_t(*sz, dtype=torch.float32) for sz in sizes] for _ in range(4)]
    flag = _t(1, dtype=torch.int32)
    return {
        "multi_tensor_adam": lambda: o.multi_tensor_adam(65536, flag, lists, 1e-3, 0.9, 0.999, 1e-8, 5, 1, bias_correction=True,
                                                         weight_decay=0.01),
        "multi_tensor_scale": lambda: o.multi_tensor_scale(65536, flag, lists[:2], 0.5),
        "multi_tensor_l2norm": lambda: o.multi_tensor_l2norm(65536, flag, lists[:1], per_tensor=True),
    }


def _attention_cases() -> Dict[str, Callable[[], object]]:
    from transformer_engine.plugin.backends.flagos import attention as fa
    from transformer_engine.plugin.catalog.attention import AttentionConfig

    q = _t(4, 2048, 32, 128)
    config = AttentionConfig(softmax_scale=128**-0.5, mask_type="causal")
    ctx = fa.FlashAttnCtx(_t(4, 32, 2048, dtype=torch.float32), 2048, 2048)
    return {
        "fused_attn_fwd causal": lambda: fa.fused_attn_fwd(q, q, q, config),
        "fused_attn_bwd causal": lambda: fa.fused_attn_bwd(q, q, q, q, q, ctx, config),
    }


FAMILIES = {
    "norm": _norm_cases, "activation": _activation_cases, "quantization": _quantization_cases,
    "softmax": _softmax_cases, "misc": _misc_cases, "optimizer": _optimizer_cases, "attention": _attention_cases,
}  # fmt: skip


def capture(only: List[str]) -> Tuple[List[Launch], List[str]]:
    """Run the selected cases' launchers on meta tensors; (launches, cases whose launcher failed)."""
    recorder, failed = _Recorder(), []
    with _capturing(recorder):
        for family, cases in FAMILIES.items():
            for name, call in cases().items():
                if only and not any(word in f"{family} {name}" for word in only):
                    continue
                recorder.case = name
                try:
                    call()
                except Exception as exc:  # noqa: BLE001 - reported, the other cases still run
                    failed.append(f"{name}: {type(exc).__name__}: {exc}")
    return recorder.launches, failed


# -- compiling and reading the machine code --------------------------------------------------------


def _compile(launch: Launch):
    """triton.compile for TARGET, specialized by Triton's own binder exactly as a GPU launch would be."""
    backend = make_backend(TARGET)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(triton.knobs.compilation, knob):
            kwargs[knob] = getattr(triton.knobs.compilation, knob)
    binder = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.fn._pack_args(backend, kwargs, bound_args, specialization, options)
    kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    grid = launch.grid(dict(bound_args)) if callable(launch.grid) else launch.grid
    return kernel, options, tuple(grid)


def _ptxas_usage(ptx: str, arch: str) -> Tuple[int, int]:
    """(registers per thread, spill bytes stored + loaded) from ``ptxas -v`` (the one Triton itself uses)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        command = [get_ptxas(TARGET.arch).path, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spill


def _sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        command = [triton.knobs.nvidia.cuobjdump.path, "-sass", str(path)]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout


_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def _width(opcode: str) -> int:
    """Bytes per thread of a LDG / STG / LDGSTS opcode ('LDG.E.128' -> 16; no size suffix -> 4)."""
    for part in opcode.split(".")[1:]:
        if part in _WIDTH:
            return _WIDTH[part]
    return 4


def sass_facts(sass: str) -> Dict[str, collections.Counter]:
    """Counts of the memory, atomic, fence and conversion instructions of a SASS listing."""
    facts = {key: collections.Counter() for key in ("ldg", "stg", "atom", "fence", "f2fp", "async", "local", "bar", "mma")}
    for opcode, _ in _INSTRUCTION.findall(sass):
        base = opcode.split(".")[0]
        if base == "LDG":
            facts["ldg"][_width(opcode)] += 1
        elif base == "STG":
            facts["stg"][_width(opcode)] += 1
        elif base in ("ATOMG", "RED", "REDG"):
            facts["atom"][opcode] += 1
        elif base in ("MEMBAR", "CCTL", "ERRBAR"):
            facts["fence"][opcode] += 1
        elif base == "F2FP":
            facts["f2fp"][opcode] += 1
        elif base == "LDGSTS":
            facts["async"][_width(opcode)] += 1
        elif base in ("LDL", "STL"):
            facts["local"][base] += 1
        elif base == "BAR":
            facts["bar"][opcode] += 1
        elif base in ("HGMMA", "QGMMA", "HMMA", "IMMA"):
            facts["mma"][base] += 1
    return facts


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)\s*([^;]*);")
_NO_DESTINATION = ("STG", "STS", "RED", "REDG", "ATOMG", "BRA", "EXIT", "BAR")


def loads_in_flight(sass: str) -> Tuple[int, int]:
    """(LDGs, bytes) a thread has outstanding, at most, when it first waits for one of them.

    Walks the listing in order: an LDG adds its destination registers; the first instruction that
    reads any of them consumes that load. Two 16-byte loads issued back to back count (2, 32);
    a second load issued only after the first one's data was used counts (1, 16).
    """
    pending: List[Tuple[set, int]] = []
    best = (0, 0)
    for opcode, operands in _INSTRUCTION.findall(sass):
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", operands)]
        base = opcode.split(".")[0]
        sources = set(regs) if base in _NO_DESTINATION else set(regs[1:])
        if any(dest & sources for dest, _ in pending):
            best = max(best, (len(pending), sum(width for _, width in pending)))
            pending = [(dest, width) for dest, width in pending if not dest & sources]
        if base == "LDG" and regs:
            width = _width(opcode)
            pending.append((set(range(regs[0], regs[0] + max(1, width // 4))), width))
    return best


def occupancy(regs: int, warps: int, smem: int) -> int:
    """Programs resident per SM on sm_90 (registers allocated per warp in units of 256)."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = _REGS_PER_SM // (regs_per_warp * warps)
    by_smem = _SMEM_PER_SM // (smem + _SMEM_RESERVED_PER_BLOCK)
    return min(by_regs, _MAX_WARPS_PER_SM // warps, _MAX_BLOCKS_PER_SM, by_smem)


def analyse(launch: Launch, dump: Optional[Path], index: int = 0) -> Report:
    """Compile one launch and read its resources and machine code."""
    try:
        kernel, options, grid = _compile(launch)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is the finding
        return Report(launch.case, launch.fn.__name__, 0, 0, (), error=f"{type(exc).__name__}: {str(exc)[:400]}")
    report = Report(launch.case, kernel.name, options.num_warps, options.num_stages, grid, smem=kernel.metadata.shared)
    report.regs, report.spill = _ptxas_usage(kernel.asm["ptx"], f"sm_{kernel.metadata.target.arch}a")
    sass = _sass(kernel.asm["cubin"])
    report.sass = sass_facts(sass)
    report.in_flight = loads_in_flight(sass)
    report.instructions = len(_INSTRUCTION.findall(sass))
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{index:03d}.{launch.case}.{kernel.name}")
        (dump / f"{stem}.ptx").write_text(kernel.asm["ptx"])
        (dump / f"{stem}.sass").write_text(sass)
    return report


# -- the table --------------------------------------------------------------------------------------


def _counts(counter: collections.Counter) -> str:
    return " ".join(f"{n}x{k}" for k, n in sorted(counter.items(), key=lambda kv: str(kv[0]))) or "-"


def _grid(report: Report, occ: int) -> str:
    programs = 1
    for g in report.grid:
        programs *= g
    waves = programs / max(occ * SM_COUNT, 1)
    return f"{programs} = {waves:.1f} w"


def print_reports(reports: List[Report]) -> None:
    header = ["case", "kernel", "warps", "st", "regs", "spill", "smem", "occ", "grid", "ldg", "in flight", "stg", "atom",
              "fence", "f2fp", "async", "mma", "sass"]
    rows = []
    for r in reports:
        if r.error:
            rows.append([r.case, r.kernel, "COMPILE ERROR: " + r.error] + [""] * (len(header) - 3))
            continue
        occ = occupancy(r.regs, r.warps, r.smem)
        f2fp = sum(n for op, n in r.sass["f2fp"].items() if "E4M3" in op or "E5M2" in op)
        rows.append([
            r.case, r.kernel, str(r.warps), str(r.stages), str(r.regs), str(r.spill + sum(r.sass["local"].values())),
            str(r.smem), str(occ), _grid(r, occ), _counts(r.sass["ldg"]), f"{r.in_flight[0]} = {r.in_flight[1]} B",
            _counts(r.sass["stg"]), _counts(r.sass["atom"]), _counts(r.sass["fence"]), str(f2fp) if f2fp else "-",
            _counts(r.sass["async"]), _counts(r.sass["mma"]), str(r.instructions),
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated substrings of '<family> <case>' to compile")
    parser.add_argument("--dump", type=Path, default=None, help="write <n>.<case>.<kernel>.ptx / .sass into this folder")
    args = parser.parse_args()
    launches, failed = capture([w for w in args.only.split(",") if w])
    seen, reports = set(), []
    for index, launch in enumerate(launches):
        report = analyse(launch, args.dump, index)
        key = (report.case, report.kernel, report.regs, report.instructions, report.grid)  # autotune configs may repeat
        if key not in seen or report.error:
            seen.add(key)
            reports.append(report)
    ptxas = get_ptxas(TARGET.arch)
    print(f"triton {triton.__version__}, ptxas {ptxas.version}, target sm_{TARGET.arch} ({SM_COUNT} SMs assumed), "
          f"{len(launches)} launches captured")  # fmt: skip
    print_reports(reports)
    for line in failed:
        print("launcher failed:", line)
    errors = [r for r in reports if r.error]
    return 1 if errors or failed else 0


if __name__ == "__main__":
    sys.exit(main())
