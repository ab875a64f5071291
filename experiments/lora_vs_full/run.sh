#!/usr/bin/env bash
# LoRA against full fine-tuning in RL, on one GPU shared by the vLLM sidecar and the FSDP2 trainer (README.md
# here): SmolLM2-135M-Instruct, the smollm2_reverse_text experiment's SFT model, then 100 RL steps per arm from it,
# then the same eval. Only the arm's overrides (and the paths) differ. Stages: experiments/smollm2_arms.sh.
#   experiments/lora_vs_full/run.sh [ARM ...]     (default: full lora lora_lr1e-5)
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/smollm2_arms.sh
LORA="model.lora.enabled=true model.lora.r=16 model.lora.alpha=32"
LORA="$LORA model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
declare -A ARMS=(
  [full]="trainer.optim.lr=1e-5"
  [lora]="$LORA trainer.optim.lr=1e-4"
  [lora_lr1e-5]="$LORA trainer.optim.lr=1e-5"
)
O=outputs/lora_vs_full
[ $# -gt 0 ] || set -- full lora lora_lr1e-5
for arm in "$@"; do  # every arm known before the first stage runs
  [[ -n "${ARMS[$arm]:-}" ]] || { echo "unknown arm $arm (have: ${!ARMS[*]})" >&2; exit 2; }
done
smollm2_sft
step $O/eval_sft/metrics.json python -m asyncrl eval $E model.name=$S/sft/model eval.out_dir=$O/eval_sft
for arm in "$@"; do
  # shellcheck disable=SC2086  # the arm's overrides are words
  rl_arm $O $arm ${ARMS[$arm]}
done
evals=() && for a in full lora lora_lr1e-5; do [ ! -f $O/eval_$a/metrics.json ] || evals+=("$O/eval_$a"); done
python -m asyncrl compare $O/eval_sft "${evals[@]}"
