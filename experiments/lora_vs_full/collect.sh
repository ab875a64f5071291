#!/usr/bin/env bash
# What run.sh produced, as one archive $OUT/lora_vs_full.tar.gz (the lent GPU machine returns $OUT): each arm's
# metrics (trainer.jsonl: train/peak_mem_gib, time/*; orchestrator.jsonl: rewards, time/update_weights_s),
# summary.json, resolved config and run_meta.json, and every eval's metrics.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/smollm2_arms.sh
collect_arms outputs/lora_vs_full lora_vs_full
