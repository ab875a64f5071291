#!/usr/bin/env bash
# `pytest -m gpu` on a lent machine of several GPUs, in lanes: first the tests that need more than one GPU (two_gpus,
# the four-GPU layouts, context parallelism) on all of them, one after the other; then the one-GPU tests dealt round
# robin to one pytest per GPU (CUDA_VISIBLE_DEVICES=i), side by side. The one-GPU tests take most of the suite's
# time, so N GPUs finish it in about 1/N of the calls benchmarks/gpu_suite.sh needs. Like gpu_suite.sh it stops
# starting tests after BUDGET_S seconds and keeps the passed ones in $GPU_PASSED: call again until nothing is left.
# Carry .vllm and .whl with the first call to a machine, .whl-vf with a later one for the verifiers tests.
#   bash benchmarks/gpu_suite_lanes.sh [BUDGET_S] [PYTEST_ARGS...]     # BUDGET_S default 480
# Figures: $OUT/gpu_tests.jsonl; logs: $OUT/pytest_multi.log, $OUT/pytest_lane<i>.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
budget=480
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then budget=$1 && shift; fi
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
mkdir -p "$out" /tmp/gpu_lanes
start=$(date +%s)
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
left() { echo $((budget - ($(date +%s) - start))); }
suite() { # NAME, then what to run (paths or test ids) and pytest options: one pytest with the time left
  local name=$1 && shift
  ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl python -m pytest -p no:cacheprovider -m gpu -rA --durations=0 \
    --budget-s "$(left)" --passed-file "$GPU_PASSED" --basetemp "/tmp/gpu_lanes/$name" "$@" >"$out/pytest_$name.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|^=+ .*(passed|failed|skipped)" "$out/pytest_$name.log" | sed "s/^/[$name] /" | cut -c1-220
}
multi="two_gpus or four_gpu_layout or context_parallel"
[ "$gpus" -ge 2 ] && suite multi tests/gpu -k "$multi" "$@"
# the one-GPU tests, dealt round robin over the GPUs (a lane's pytest sees one GPU, so it skips the others' tests)
mapfile -t ids < <(python -m pytest -p no:cacheprovider -m gpu tests/gpu --collect-only -q -k "not ($multi)" "$@" \
  2>/dev/null | grep "::")
for ((i = 0; i < gpus; i++)); do
  mine=()
  for ((j = i; j < ${#ids[@]}; j += gpus)); do mine+=("${ids[j]}"); done
  [ ${#mine[@]} -gt 0 ] && CUDA_VISIBLE_DEVICES=$i suite "lane$i" "${mine[@]}" &
done
wait
echo "passed so far (all calls with this code): $(wc -l <"$GPU_PASSED" 2>/dev/null || echo 0) of ${#ids[@]} one-GPU tests and the multi-GPU ones"
