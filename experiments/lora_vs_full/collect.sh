#!/usr/bin/env bash
# What run.sh produced, as one archive $OUT/lora_vs_full.tar.gz (the lent GPU machine returns $OUT): each arm's
# metrics (trainer.jsonl: train/peak_mem_gib, time/*; orchestrator.jsonl: rewards, time/update_weights_s),
# summary.json, resolved config and run_meta.json, and every eval's metrics.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
O=outputs/lora_vs_full
files=$(cd $O && ls -d eval_*/metrics.json */rl/metrics/*.jsonl */rl/metrics/summary.json */rl/configs/config.yaml \
  */rl/run_meta.json 2>/dev/null || true)
tar -czf "$OUT/lora_vs_full.tar.gz" -C $O $files
tar -tzf "$OUT/lora_vs_full.tar.gz"
