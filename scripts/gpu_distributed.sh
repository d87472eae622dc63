#!/usr/bin/env bash
# Multi-GPU checks of tensor / sequence / data / context parallelism, in one call on a 2- or 4-GPU machine:
#   tests  the distributed tests on NCCL (tests/pytorch/parallel and the context-parallel tests, the gpu-marked
#          variants: 2 ranks, and 4 ranks when there are 4 GPUs; the gloo variants run on CPU in CI), and the
#          GPU tests of the ring's attention blocks
#   bench  benchmarks/bench_tp.py: te.TransformerLayer at TP=2 + sequence parallelism vs one GPU,
#          bf16 and FP8 (and TP=4 when there are 4 GPUs); tables in the log, JSON in $OUT
#   cp     benchmarks/bench_cp.py: context parallelism, DotProductAttention and TransformerLayer at
#          sequence 32768 and 65536, CP=2 per comm type (p2p, a2a, all_gather) vs one GPU (and CP=4
#          when there are 4 GPUs); tables in the log, JSON in $OUT
# Usage: OUT=/some/dir bash scripts/gpu_distributed.sh [tests] [bench] [cp]     (default: tests bench)
# NVLink multicast stays off (NCCL, and symmetric memory for the pipelined collectives), as the lent machines require.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/gpu_distributed.log"
STAGES=${*:-tests bench}
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
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

echo "GPUs: $GPUS" | tee -a "$LOG"
for stage in $STAGES; do
    case $stage in
        tests) run tests 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/pytorch/parallel \
                   tests/pytorch/attention/test_context_parallel.py tests/plugin/backends/vendor/cuda/test_attention_block.py ;;
        bench)
            run tp2 450 python3 benchmarks/bench_tp.py --tp 2 --json "$OUT/tp2.json"
            if [ "$GPUS" -ge 4 ]; then run tp4 400 python3 benchmarks/bench_tp.py --tp 4 --json "$OUT/tp4.json"; fi ;;
        cp)
            run cp2 420 python3 benchmarks/bench_cp.py --cp 2 --json "$OUT/cp2.json"
            if [ "$GPUS" -ge 4 ]; then run cp4 420 python3 benchmarks/bench_cp.py --cp 4 --json "$OUT/cp4.json"; fi ;;
        *) echo "unknown stage $stage" ;;
    esac
done

echo; echo "=== tables"; grep -E '^(\||[A-Z].*fwd\+bwd)' "$LOG" | tail -120
echo; echo "=== test summary"; grep -E '(passed|failed|error)' "$LOG" | grep -v '^|' | tail -5
echo; echo "=== stages"; printf '%s\n' "${summary[@]}"
