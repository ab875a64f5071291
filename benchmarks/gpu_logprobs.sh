#!/usr/bin/env bash
# On the lent GPU: where logprobs cost vLLM its speed and what inference.vllm.defer_logprobs wins
# back. Two parts, each about 6-7 minutes on an H100 (one call may run 10): carry .vllm (the bundle) and .whl
# (benchmarks/device_wheels.sh tools) with the first; the second can go to the same warm machine without them.
#   bash benchmarks/gpu_logprobs.sh bare       # logprobs_cost.py (plain and logprobs, the deferred_* rows, each
#                                              # round split into decode steps and the frontend's tail, py-spy
#                                              # profiles of the engines' processes, waits counted) and the GPU
#                                              # test that deferred logprobs equal streamed ones
#   bash benchmarks/gpu_logprobs.sh asyncrl    # the asyncrl path both ways: rollouts.py --defer-logprobs 0 1
#   bash benchmarks/gpu_logprobs.sh kernels    # plain against deferred logprobs under vLLM's torch profiler
#                                              # (logprobs_cost.py --kernels; about 3 minutes)
#   bash benchmarks/gpu_logprobs.sh sidecar [0.6b|4b] [ROUNDS]
#                                              # where the sidecar path with logprobs loses to bare plain vLLM:
#                                              # rollouts.py, compact form, ROUNDS (default 5) interleaved rounds,
#                                              # then py-spy of the sidecar and the client per arm
# Results and logs go under $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
case "${1:-}" in bare | asyncrl | kernels | sidecar) ;; *) echo "usage: $0 bare|asyncrl|kernels|sidecar" >&2 && exit 2 ;; esac
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
spy=$(find /tmp/extra -name py-spy -type f 2>/dev/null | head -1)
quiet() { grep -v -E "^(INFO|WARNING|DEBUG|\(EngineCore)|Writing model|Loading weights"; }
case "${1:-}" in
  bare)
    python benchmarks/logprobs_cost.py --out "$out/logprobs_cost.json" --repeats 3 --skip-raw --variants plain logprobs \
      ${spy:+--pyspy "$spy" --pyspy-idle --pyspy-seconds 10} \
      2>&1 | tee "$out/logprobs_cost.log" | quiet | grep -v -E "^  (self|all) " | tail -40
    ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl timeout 300 python -m pytest -p no:cacheprovider -m gpu \
      tests/gpu/test_gpu.py -k deferred -q 2>&1 | tail -5
    ;;
  asyncrl)
    python benchmarks/rollouts.py --defer-logprobs 0 1 --repeats 3 --out "$out/rollouts_defer.json" 2>&1 \
      | tee "$out/rollouts.log" | quiet | tail -12
    ;;
  sidecar)
    shape=${2:-4b}
    python benchmarks/rollouts.py --shape "$shape" --forms compact --repeats "${3:-5}" --no-weight-update \
      ${spy:+--pyspy "$spy"} --out "$out/rollouts_sidecar_$shape.json" 2>&1 | tee "$out/rollouts_sidecar_$shape.log" \
      | quiet | grep -v -E "^  all " | tail -120
    ;;
  kernels)
    python benchmarks/logprobs_cost.py --kernels --repeats 3 --out "$out/logprobs_kernels.json" 2>&1 \
      | tee "$out/logprobs_kernels.log" | quiet | grep -v -E "^ |^-" | tail -8
    head -30 "$out/kernels_logprobs.txt" 2>/dev/null | cut -c1-160
    ;;
esac
