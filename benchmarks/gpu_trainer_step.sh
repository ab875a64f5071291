#!/usr/bin/env bash
# On a lent GPU: the trainer step as it is against trainer_mfu.py's baseline step variant (Fabric's bf16-mixed
# casting the logits to fp32, micro-batches copied one by one from pageable memory, boundaries and loss metrics
# read on the host each micro-batch), side by side in one run, compiled, varlen, 4 rows of 16k, one and two rows
# per forward, strategy=auto; then the same two steps under FSDP2 (whose precision never cast the logits). One
# profiled step each. About 8 minutes on an H200; carry .whl (benchmarks/device_wheels.sh tools).
#   bash benchmarks/gpu_trainer_step.sh      # results and op tables under $OUT (or ./gpu_out)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
run() {  # NAME TIMEOUT_S EXTRA...
  local name=$1 limit=$2 && shift 2
  timeout "$limit" python benchmarks/trainer_mfu.py --row-lens 16384 --attn varlen --rows 4 --compile 1 --steps 5 \
    --warmup 3 --step-variant unfused current --profile "$out/prof_$name" --out "$out/trainer_step_$name.json" "$@" 2>&1 \
    | tee "$out/trainer_step_$name.log" | grep -v -E "^(INFO|WARNING)|Writing model" | tail -6
}
run auto 340 --mb-rows 1 2 --extra trainer.fabric.strategy=auto
run fsdp2 200 --mb-rows 1
rm -f "$out"/prof_*/*_trace.json.gz  # the op tables come back; the traces are too large for one call's return
