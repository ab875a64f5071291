#!/usr/bin/env bash
# `pytest -m gpu` on a lent machine of several GPUs, in lanes: the tests that need four GPUs (marked four_gpus) on all
# of them, the two-GPU tests (marked two_gpus) dealt round robin to pairs of GPUs, and the one-GPU tests
# dealt round robin to single GPUs, one pytest per lane side by side (CUDA_VISIBLE_DEVICES), and last the one-GPU
# tests marked trainer_env (flash-attn-4, which lives in the trainer's own environment only) the same way under
# $TRAINER_PYTHON (device_env.sh; without it they run under python and skip). The phases run in
# LANE_ORDER (default "4 2 1 t"), each after the last has ended; LANES_K ands a -k expression into every phase;
# LANE_GPUS (e.g. "0,1,2") keeps the lanes to those GPUs and leaves the others to a command beside them. The
# SFT-warmed GPU models are built once per machine and shared by every lane and call (tests/gpu/conftest.py,
# $ASYNCRL_GPU_SETUP_DIR). Like gpu_suite.sh it stops starting tests BUDGET_S seconds after the call began and keeps
# the passed ones in $GPU_PASSED: call again until nothing is left. Carry .vllm and .whl with the first call to a
# machine; .whl-vf (the verifiers tests) and .vllm-moe (vLLM's MoE kernels: benchmarks/device_moe_kernels.sh) with a
# later one. A passed list kept here (outputs/gpu_suite/) may be carried to a fresh machine, never to a warm one: it
# replaces the machine's newer list. A test started before BUDGET_S may run past it, so every lane is interrupted at
# DEADLINE_S (default 570, under a call's 600, counted like BUDGET_S from the call's start, set-up included), and the
# passed list and the lanes' logs are copied to $OUT every few seconds: a call cut short still returns them, and a
# later session with the same code carries the list (as outputs/gpu_suite) to a fresh machine.
#   [LANE_ORDER="1 2 t"] [LANES_K="not moe"] [LANE_GPUS=0,1] [DEADLINE_S=570] bash benchmarks/gpu_suite_lanes.sh [BUDGET_S] [PYTEST_ARGS...]
# Figures: $OUT/gpu_tests.jsonl; logs: $OUT/lanes/pytest_<lane>.log.
set -uo pipefail
start=$(date +%s) # before the set-up, which a fresh machine spends a minute on
cd "$(dirname "$0")/.." || exit 2
budget=480
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then budget=$1 && shift; fi
for arg in "$@"; do # a -m of the caller's would replace each phase's own
  [[ $arg != -m* ]] || { echo "gpu_suite_lanes.sh: select with LANES_K, not $arg (each phase selects by marks)" >&2 && exit 2; }
done
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
tmp=${LANES_TMP:-/tmp/gpu_lanes}
logs=$tmp/logs-$start
mkdir -p "$out" "$logs"
ASYNCRL_GPU_SETUP_DIR=$tmp/setup-$(cat outputs/gpu_suite/code) && export ASYNCRL_GPU_SETUP_DIR
if [ -n "${LANE_GPUS:-}" ]; then read -ra gpu_ids <<<"${LANE_GPUS//,/ }"; else
  mapfile -t gpu_ids < <(seq 0 $(($(nvidia-smi -L | wc -l) - 1))); fi
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
deadline=${DEADLINE_S:-570}
keep() { mkdir -p "$out/gpu_suite" "$out/lanes" && cp outputs/gpu_suite/code "$out/gpu_suite/" && touch "$GPU_PASSED" &&
  cp "$GPU_PASSED" "$out/gpu_suite/" && cp "$logs"/*.log "$out/lanes/" 2>/dev/null; }
(while sleep 5; do keep; done) >/dev/null 2>&1 & # off the output: its last sleep outlives it
keeper=$!
left() { echo $((budget - ($(date +%s) - start))); }
suite() { # NAME, the interpreter, then what to run (test ids) and pytest options: one pytest with the time left
  local name=$1 py=$2 until=$((deadline - ($(date +%s) - start))) && shift 2
  [ "$until" -gt 0 ] || return 0 # timeout 0 would mean none
  ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl timeout -s INT -k 15 "$until" "$py" -m pytest -p no:cacheprovider -m gpu -rA --durations=0 \
    --budget-s "$(left)" --passed-file "$GPU_PASSED" --basetemp "$tmp/$name" "$@" >"$logs/pytest_$name.log" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|^=+ .*(passed|failed|skipped)" "$logs/pytest_$name.log" | sed "s/^/[$name] /" | cut -c1-220
}
declare -A phase_m=([4]="four_gpus" [2]="two_gpus and not four_gpus"
  [1]="not (two_gpus or four_gpus or trainer_env)" [t]="trainer_env and not (two_gpus or four_gpus)")
for phase in ${LANE_ORDER:-4 2 1 t}; do
  width=${phase/t/1} py=python prefix=
  [ "$phase" != t ] || py=${TRAINER_PYTHON:-python} prefix=trainer_
  lanes=$((${#gpu_ids[@]} / width))
  [ "$lanes" -ge 1 ] || continue
  mapfile -t ids < <(python -m pytest -p no:cacheprovider -m "gpu and (${phase_m[$phase]})" tests/gpu --collect-only \
    -q ${LANES_K:+-k "$LANES_K"} "$@" 2>/dev/null | grep "::")
  pids=() # the lanes of this phase: a bare `wait` would also wait for the keeper, which never ends
  for ((i = 0; i < lanes; i++)); do
    mine=()
    for ((j = i; j < ${#ids[@]}; j += lanes)); do mine+=("${ids[j]}"); done
    devices=$(IFS=, && echo "${gpu_ids[*]:i*width:width}")
    [ ${#mine[@]} -gt 0 ] || continue
    CUDA_VISIBLE_DEVICES=$devices suite "${prefix}gpus${devices//,/_}" "$py" "${mine[@]}" "$@" &
    pids+=($!)
  done
  [ ${#pids[@]} -eq 0 ] || wait "${pids[@]}"
done
kill "$keeper" # its last copy may overlap the one below: both copy the same files
keep
echo "passed so far (all calls with this code): $(wc -l <"$GPU_PASSED" 2>/dev/null || echo 0)"
