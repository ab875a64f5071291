#!/usr/bin/env bash
# Long samples on a lent GPU machine, two parts, run side by side when both are named (carry .vllm and .whl with the
# first call to the machine):
#   - cp, on GPUs $CP_GPUS (default 2,3): one 64k-token sample per step on one GPU with activation checkpointing against two with context
#     parallelism (benchmarks/context_parallel.py), then the Qwen3-4B shape's trainer alone on GPU 3 at 16k rows,
#     profiled (benchmarks/trainer_mfu.py --shape 4b --profile): where the trainer's step goes;
#   - longtail, on GPUs 0-1: the continuous schedule against step on heavy-tailed completions, vLLM on GPU 0 and the trainer on
#     GPU 1 (layout=2gpu, NCCL), the Qwen3-0.6B shape (benchmarks/rl_step.py --compare schedule --longtail).
#   bash benchmarks/gpu_long_samples.sh cp longtail          # four GPUs
#   CP_GPUS=0,1 bash benchmarks/gpu_long_samples.sh cp       # two GPUs: one part per call
#   LONGTAIL_STEPS=20 bash benchmarks/gpu_long_samples.sh longtail
# Results and logs go under $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
steps=${LONGTAIL_STEPS:-20}
cp_gpus=${CP_GPUS:-2,3}
parts=" $* "
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
cp_part() {
  python benchmarks/context_parallel.py --gpus "$cp_gpus" --length 65536 --rows 1 --steps 3 --arms 1gpu_ac cp2 cp2_ac \
    --out "$out/context_parallel_64k.json" >"$out/context_parallel_64k.log" 2>&1
  echo "context_parallel exit $?" && tail -8 "$out/context_parallel_64k.log"
  CUDA_VISIBLE_DEVICES=${cp_gpus##*,} python benchmarks/trainer_mfu.py --shape 4b --row-lens 16384 --attn varlen --ac 1 \
    --compile 1 --rows 2 --steps 4 --warmup 2 --profile "$out/trainer_4b_profile" \
    --out "$out/trainer_mfu_4b.json" >"$out/trainer_mfu_4b.log" 2>&1
  echo "trainer_mfu 4b exit $?" && tail -4 "$out/trainer_mfu_4b.log"
}
longtail_part() {
  local q06=/dev/shm/q06
  [ -f "$q06/config.json" ] || python -m asyncrl prepare experiment=reverse_text model=qwen3_0.6b_shape \
    "model.name=$q06" "data_dir=/dev/shm/q06_data" >"$out/prepare_q06.log" 2>&1
  python benchmarks/rl_step.py --compare schedule --longtail --model "$q06" --run-root /dev/shm --steps "$steps" \
    --repeats 1 --out "$out/rl_longtail_2gpu.json" model=qwen3_0.6b_shape layout=2gpu data_dir=/dev/shm/q06_data \
    inference.vllm.gpu_memory_utilization=0.85 inference.vllm.max_num_seqs=1024 orchestrator.max_concurrency=2048 \
    trainer.fabric.num_threads=0 trainer.micro_batch_rows=1 seq_len=8192 orchestrator.prompts_per_step=32 \
    orchestrator.group_size=16 orchestrator.max_tokens=512 trainer.optim.lr=1e-6 >"$out/rl_longtail_2gpu.log" 2>&1
  echo "rl_step longtail exit $?" && tail -8 "$out/rl_longtail_2gpu.log"
}
if [[ $parts == *" cp "* ]]; then cp_part & fi
if [[ $parts == *" longtail "* ]]; then longtail_part; fi
wait
