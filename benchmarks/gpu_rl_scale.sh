#!/usr/bin/env bash
# On a lent 4-GPU machine: the Qwen3-4B shape (random init, Qwen3's vocabulary) through a whole RL run laid out by
# one `asyncrl rl` command, then where its time went (benchmarks/rl_scale.py). Carry .vllm and .whl with the first call.
#   bash benchmarks/gpu_rl_scale.sh [LAYOUT] [STEPS] [OVERRIDES...]   # default: 4gpu_2replicas, 5 steps
# Samples of 8,000 tokens (ignore_eos: a random model rarely ends), two per 16k packed row; groups of equal reward are
# kept (drop_zero_advantage=false) so every step trains its full batch. Results and logs go under $OUT (or ./gpu_out).
# The trainer in its own environment (flash-attn-4 carried as .whl-fa4 pieces, benchmarks/device_env.sh's
# TRAINER_PYTHON): add `launcher.trainer_python=/tmp/trainer-python weights.transport=filesystem`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
layout=${1:-4gpu_2replicas}
steps=${2:-5}
shift $(($# < 2 ? $# : 2))
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
root=${RL_SCALE_ROOT:-/dev/shm/rl_scale}
mkdir -p "$out" "$root"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
common=(model=qwen3_4b_shape "model.name=$root/model" "data_dir=$root/data" env=[reverse_text])
[ -f "$root/model/config.json" ] || { time python -m asyncrl prepare "${common[@]}" >"$out/prepare.log" 2>&1 || tail -20 "$out/prepare.log"; }
args=("${common[@]}" "layout=$layout" "run_dir=$root/run_$layout" launcher.overwrite=true launcher.progress=false
  max_steps="$steps" seq_len=16384 orchestrator.max_tokens=8000 orchestrator.prompts_per_step=8
  orchestrator.group_size=4 "+orchestrator.extra_body={ignore_eos: true}" orchestrator.drop_zero_advantage=false
  orchestrator.schedule=continuous inference.vllm.max_model_len=16384 trainer.micro_batch_rows=1
  trainer.fabric.activation_checkpointing=true trainer.fabric.compile=true trainer.fabric.num_threads=0 "$@")
nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 \
  >"$out/gpu_util_$layout.csv" &
smi=$!
start=$(date +%s)
timeout "${RL_SCALE_TIMEOUT:-480}" python -m asyncrl rl "${args[@]}" >"$out/rl_$layout.log" 2>&1
rc=$?
kill "$smi"
echo "asyncrl rl exit $rc after $(($(date +%s) - start)) s"
[ $rc = 0 ] || { tail -30 "$out/rl_$layout.log"; for f in "$root/run_$layout"/logs/*.log; do echo "== $f"; grep -v -E "^(INFO|DEBUG)" "$f" | tail -15; done; }
trainer_gpus=$(python -c "from asyncrl.config.compose import compose_config as c; print(c(['layout=$layout']).trainer.fabric.gpus)")
python benchmarks/rl_scale.py --run "$root/run_$layout" --model "$root/model" --util "$out/gpu_util_$layout.csv" \
  --trainer-gpus "$trainer_gpus" --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --command "bash benchmarks/gpu_rl_scale.sh $layout $steps $*" --out "$out/rl_scale_$layout.json"
cp "$root/run_$layout/metrics/"*.jsonl "$out/" 2>/dev/null
# the engines' own view: vLLM's periodic throughput, queue and KV-cache lines, and any preemption
for f in "$root/run_$layout"/logs/inference*.log; do
  grep -E "throughput|KV cache|preempt|Maximum concurrency|GPU blocks" "$f" >"$out/$(basename "$f" .log)_stats.log"
done
