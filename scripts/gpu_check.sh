#!/usr/bin/env bash
# Everything we check on the H200 in one call: GPU tests, then each benchmark (JSON + logs to $OUT),
# then a short summary. Usage on the GPU machine: OUT=/some/dir bash scripts/gpu_check.sh [stage ...]
# Stages: info tests kernel-tests kernels norms sweep attention linear layer profile host dispatch jax demo (default: all,
# in order; tests: the GPU tests outside tests/plugin/backends/flagos and the torch.compile ones, kernel-tests: every
# flagos kernel test compiled, odd small shapes included, about 8 minutes of compiling);
# also compile (the torch.compile GPU tests, tests/pytorch/test_compile_gpu.py: more than 6 minutes on an H100, so a
# call of their own), sizes (bench_sizes.py; SIZES_HIDDEN picks the hidden sizes,
# SIZES_COMPILE_OPS=traced,custom_op also times the compiled layer with opaque custom ops, SIZES_MODES the modes timed),
# accelerate (a HF Llama trained through HF Accelerate, FP8 vs bf16, eager and with Inductor), demo (DEMO_ARGS: more
# arguments of te-fl demo, e.g. "--recipe nvfp4 --size medium"),
# graphs (the CUDA-graph tests alone, a quick check), memory (what the headline layer's peak consists of) and
# ab (bench_ab.py: this tree against the tree in $AB_BASE, timed in turns; see its docstring).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STAGES=${*:-info tests kernel-tests kernels norms sweep attention linear layer profile host dispatch jax demo}
summary=()

run() {  # run NAME TIMEOUT CMD...: log everything, remember the exit code and the time
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    summary+=("$(printf '%-10s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
    return 0
}

install() {  # the package (clients such as Lightning check its metadata) and wheels carried in .whl/ (megatron-core)
    python3 -m pip install -q --no-deps --no-build-isolation -e . .whl/*.whl >/dev/null 2>&1 \
        || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
}

for stage in $STAGES; do
    case $stage in
        info) run info 120 python3 -m transformer_engine info ;;
        tests) install; run tests 590 python3 -m pytest -q -m gpu -p no:cacheprovider tests --ignore=tests/plugin/backends/flagos \
                   --ignore=tests/pytorch/test_compile_gpu.py ;;
        kernel-tests) run kernel-tests 590 python3 -m pytest -q -p no:cacheprovider tests/plugin/backends/flagos ;;
        compile) run compile 590 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pytorch/test_compile_gpu.py ;;
        accelerate) install; run accelerate 420 python3 benchmarks/bench_accelerate_llama.py --json "$OUT/accelerate.json" ;;
        sizes) run sizes 560 python3 benchmarks/bench_sizes.py --hidden "${SIZES_HIDDEN:-1024,2048,4096}" --compile-ops "${SIZES_COMPILE_OPS:-traced}" \
                   --modes "${SIZES_MODES:-eager,compile,compile-cpp,compile-graphs,graphs}" --json "$OUT/sizes.json" --plot "$OUT/sizes.png" ;;
        graphs) run graphs 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pytorch/test_graph.py ;;
        kernels) run kernels 300 python3 benchmarks/bench_kernels.py --json "$OUT/kernels.json" ;;
        norms) run norms 120 python3 benchmarks/bench_norm_modules.py --json "$OUT/norms.json" ;;
        sweep) run sweep 300 python3 benchmarks/sweep_fp8_casts.py --json "$OUT/sweep.json" ;;
        attention) run attention 240 python3 benchmarks/bench_attention.py --json "$OUT/attention.json" ;;
        linear) run linear 240 python3 benchmarks/bench_linear.py --json "$OUT/linear.json" ;;
        layer) run layer 420 python3 benchmarks/bench_transformer_layer.py --json "$OUT/layer.json" ;;
        memory) run memory 240 python3 benchmarks/profile_layer.py --variants plain,bf16,fp8_delayed,fp8_current --memory-only --json "$OUT/memory.json" ;;
        profile) run profile 300 python3 benchmarks/profile_layer.py --json "$OUT/profile.json" ;;
        host) run host 300 python3 benchmarks/bench_host_overhead.py --json "$OUT/host.json" ;;
        dispatch) run dispatch 120 python3 benchmarks/bench_dispatch.py ;;
        ab) if [ -n "${AB_BASE:-}" ]; then run ab 420 python3 benchmarks/bench_ab.py --base-tree "$AB_BASE" --json "$OUT/ab.json"
            else echo "ab: set AB_BASE to a directory holding the base tree's transformer_engine (see benchmarks/bench_ab.py)"; fi ;;
        jax) run jax 300 python3 benchmarks/bench_jax_transformer.py --json "$OUT/jax.json" ;;
        demo) run demo 300 python3 -m transformer_engine demo --out "$OUT/demo" ${DEMO_ARGS:-} ;;
        *) echo "unknown stage $stage" ;;
    esac
done

echo; echo "=== tables"; grep -E '^(\||[A-Z].*(TFLOP|GB/s|fwd\+bwd|overhead))' "$LOG" | tail -120
echo; echo "=== test summary"; grep -E '(passed|failed|error)' "$LOG" | tail -5
# pytest's -ra lists "SKIPPED [n] file:line: reason" per location; sum them per stage and reason, so that a
# tier skipped wholesale on the GPU (no CUDA seen, a missing package, a planner refusing) shows as one big line
echo; echo "=== skipped, per stage and reason (count stage: reason)"
awk '/^=== [a-z-]+: /{stage=$2; sub(":", "", stage)}
     /^SKIPPED \[[0-9]+\] /{n=$2; gsub(/[][]/, "", n); r=$0; sub(/^SKIPPED \[[0-9]+\] [^ ]*: /, "", r); sub(/^Skipped: /, "", r); c[stage ": " r]+=n}
     END{for (k in c) printf "%6d %s\n", c[k], k}' "$LOG" | sort -rn | head -40
echo; echo "=== stages"; printf '%s\n' "${summary[@]}"
