#!/usr/bin/env bash
# On the lent GPU (best an H200, the card the attention bar is set for): the attention kernels side by side
# (each against the exact fp32 answer), then the compiled trainer (4 rows of 16k a step, strategy=auto) on torch's
# varlen kernel, on flash-attn-4 as transformers calls it (flash_attention_4: an autograd.Function that dynamo cannot
# trace) and on flash-attn-4 as asyncrl's custom ops (varlen_fa4, models/fa4.py), one profiled step each, in one run.
# The eager trainer is left out: half the compiled one's speed and 2 more minutes (benchmarks/results/ holds the
# dated runs, flash-attn-4 against torch's kernel alone and in the compiled trainer).
# flash-attn-4 arrives in two pieces (benchmarks/device_wheels.sh -o .whl-fa4 fa4): carry .whl-fa4.part1 and
# .whl-fa4.part2 in two calls to the same warm machine (beside other work), then run this, with .whl (tools) carried
# once to that machine. About 6 minutes.
#   bash benchmarks/gpu_attention.sh
# Results and logs go under $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
# the extras first: a vLLM bundle unpacked here earlier holds an older apache-tvm-ffi than flash-attn-4 needs
export PYTHONPATH=$EXTRA_PATHS:$PYTHONPATH
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python -c "import flash_attn.cute" 2>/dev/null || echo "flash-attn-4 is not installed here: its rows will say so"
timeout 100 python benchmarks/attention_kernels.py --kernels torch_varlen flash_attn4 fa4_ops \
  --out "$out/attention_kernels.json" 2>&1 | tee "$out/attention_kernels.log" | tail -12
attn=(varlen)
python -c "import flash_attn.cute" 2>/dev/null && attn+=(flash_attention_4 varlen_fa4)
timeout 470 python benchmarks/trainer_mfu.py --row-lens 16384 --attn "${attn[@]}" --rows 4 --compile 1 \
  --mb-rows 1 --steps 5 --warmup 3 --extra trainer.fabric.strategy=auto --profile "$out/prof" \
  --out "$out/trainer_mfu_attn.json" 2>&1 | tee "$out/trainer_mfu_attn.log" | grep -v -E "^(INFO|WARNING)" | tail -14
rm -f "$out"/prof/*_trace.json.gz  # the op tables come back; the traces are too large for one call's return
