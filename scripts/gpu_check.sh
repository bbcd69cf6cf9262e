#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA, in under 8 minutes on one GPU:
#   1. the GPU test tier:  pytest tests/gpu -q   (tests that need 2 GPUs skip on one and say so);
#   2. the calibration:    lightning-parallel plan --calibrate (matmul by shape and dtype, memory bandwidth, the four
#      collectives over NCCL when there are 2+ GPUs, host overhead; cached in $LIGHTNING_PARALLEL_CACHE, default
#      ~/.cache/lightning-parallel), so that the benchmark's --predict uses this machine's rates;
#   3. the benchmark:      python benchmarks/bench.py --device cuda --quick --predict
#      (cases needing more GPUs than present are skipped and listed; on ONE GPU it runs --dp 1 --cases ddp,zero3:
#      lp_ddp and lp_sharded ZeRO-3 on one rank next to DDP / FSDP2 by hand and Lightning's built-ins, since every
#      case of the full table needs 2 GPUs or more);
# then a short summary. Without CUDA it says so and exits 0.
#
#   bash scripts/gpu_check.sh                 # set-up as scripts/test.sh (scripts/_env.sh), then both checks
#   LP_GPU_CHECK_OUT=folder bash scripts/gpu_check.sh   # where the benchmark writes (default runs/gpu_check/<date>)
#
# Each part runs under a time limit (LP_GPU_TESTS_TIMEOUT, default 210 s; LP_GPU_CALIBRATE_TIMEOUT, default 90 s;
# LP_GPU_BENCH_TIMEOUT, default 240 s), so
# the whole check ends in time; a part that runs out says so. DeepSpeed is not installed by this check
# (LP_SKIP_DEEPSPEED=1 unless set): the cases that need it are skipped and say so. Exit status: 0 when nothing
# failed (skips included), 1 otherwise.
set -uo pipefail
LP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$LP_ROOT"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu_check] no CUDA device here (nvidia-smi lists no GPU): the GPU checks need one; nothing run."
  exit 0
fi

export LP_SKIP_DEEPSPEED="${LP_SKIP_DEEPSPEED:-1}"
# shellcheck source=scripts/_env.sh
source "$LP_ROOT/scripts/_env.sh"  # sets PY; exits on a failed set-up
set +e  # from here on a failing check is reported, not fatal

gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)"
if [ -z "$gpus" ] || [ "$gpus" -lt 1 ]; then
  echo "[gpu_check] nvidia-smi lists a GPU but torch in $PY has no CUDA (a CPU build?): nothing run."
  exit 0
fi
names="$(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | sed 's/^ *//' | paste -sd ';' -)"
echo "[gpu_check] $gpus GPU(s): $names"

out="${LP_GPU_CHECK_OUT:-runs/gpu_check/$(date +%F)}"
mkdir -p "$out"
start=$(date +%s)

t0=$(date +%s)
timeout "${LP_GPU_TESTS_TIMEOUT:-210}" "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
tests_s=$(( $(date +%s) - t0 ))

t0=$(date +%s)
timeout "${LP_GPU_CALIBRATE_TIMEOUT:-90}" "$PY" -m lightning_parallel.cli plan --calibrate 2>&1 | tee "$out/calibrate.log"
calibrate_rc=${PIPESTATUS[0]}
calibrate_s=$(( $(date +%s) - t0 ))

bench_args=(--device cuda --quick --predict --out "$out" --timeout 120)
if [ "$gpus" -lt 2 ]; then
  bench_args+=(--dp 1 --cases ddp,zero3)
  echo "[gpu_check] one GPU: the benchmark runs ddp and zero3 on one rank (--dp 1); every other case needs 2+ GPUs"
fi
t0=$(date +%s)
timeout "${LP_GPU_BENCH_TIMEOUT:-240}" "$PY" benchmarks/bench.py "${bench_args[@]}" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
bench_s=$(( $(date +%s) - t0 ))

verdict() {  # exit status -> words
  case "$1" in
    0) echo "passed" ;;
    124) echo "ran out of time" ;;
    *) echo "FAILED (exit $1)" ;;
  esac
}
echo
echo "[gpu_check] summary ($(( $(date +%s) - start )) s in all, $gpus GPU(s): $names)"
echo "  tests/gpu:  $(verdict "$tests_rc") in ${tests_s} s -- $(grep -E '(passed|failed|skipped|error)' "$out/tests.log" | tail -1)"
echo "  calibrate:  $(verdict "$calibrate_rc") in ${calibrate_s} s -- $(grep -E '^  matmul bf16|calibrated peak' "$out/calibrate.log" | tr -s ' ' | paste -sd ';' -)"
echo "  benchmark:  $(verdict "$bench_rc") in ${bench_s} s -- $out/results.md"
if [ -f "$out/results.md" ] && [ "$bench_rc" != 124 ]; then
  grep -E '^\| [a-z0-9-]+ \| lp_' "$out/results.md" | cut -d'|' -f2,3,5,6 | sed 's/^/    /'
  grep -E '^- .*skipped' "$out/results.md" | sed 's/^/    /'
  grep -E '^Ranking by|^Same ranking' "$out/results.md" | sed 's/^/    /'
fi
[ "$tests_rc" = 0 ] && [ "$calibrate_rc" = 0 ] && [ "$bench_rc" = 0 ]
