#!/usr/bin/env bash
# What run.sh produced, as one archive $OUT/bitwise_vs_fast.tar.gz (train/mismatch_kl and time/* in trainer.jsonl,
# rewards in orchestrator.jsonl, summary.json, resolved config, run_meta.json, each eval's metrics.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/smollm2_arms.sh
collect_arms outputs/bitwise_vs_fast bitwise_vs_fast
