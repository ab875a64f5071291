#!/usr/bin/env bash
# `pytest -m gpu` on a lent GPU machine, spread over several calls to the same warm machine (one call may run 10
# minutes; the one-GPU suite takes longer). Each call runs the tests that have not passed yet (their ids are kept in
# $GPU_PASSED, set by device_env.sh: it stays on the machine between calls, and is cleared when the code changes) until
# BUDGET_S seconds are spent, and says what it left; call again until nothing is left. Carry .vllm and .whl (benchmarks/device_wheels.sh tools) with the
# first call to a machine, and .whl-vf (device_wheels.sh -o .whl-vf verifiers) with one of them for the verifiers
# tests. tests/helpers/suite_budget.py has the two options.
#   bash benchmarks/gpu_suite.sh [BUDGET_S] [PYTEST_ARGS...]     # BUDGET_S default 360
# Figures: $OUT/gpu_tests.jsonl (appended by each call); log: $OUT/pytest.log.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
budget=360
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then budget=$1 && shift; fi
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
ran() { [ "$1" -eq 5 ] && echo 0 || echo "$1"; } # 5: PYTEST_ARGS selected none of a run's tests
ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl python -m pytest -p no:cacheprovider -m "gpu and not trainer_env" tests/gpu \
  -rA --durations=0 --budget-s "$budget" --passed-file "$GPU_PASSED" "$@" >"$out/pytest.log" 2>&1
rc=$(ran $?)
# the tests marked trainer_env (flash-attn-4) under the trainer's own interpreter (device_env.sh), in the time left
left=$((budget - ($(date +%s) - start)))
if [ "$left" -gt 0 ]; then
  ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl "${TRAINER_PYTHON:-python}" -m pytest -p no:cacheprovider \
    -m "gpu and trainer_env" tests/gpu -rA --durations=0 --budget-s "$left" --passed-file "$GPU_PASSED" "$@" \
    >>"$out/pytest.log" 2>&1
  trainer_rc=$(ran $?)
  [ "$rc" -ne 0 ] || rc=$trainer_rc
fi
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^[0-9.]+s (call|setup)|^=+ .*(passed|failed|skipped)" "$out/pytest.log" | cut -c1-220
echo "passed so far (all calls with this code): $(cat "$GPU_PASSED" 2>/dev/null | wc -l); pytest exit $rc"
exit "$rc"
