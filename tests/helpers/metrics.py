"""Reading what runs write: JSONL files, and the learning metrics (timing keys left out) that equal runs
share."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# metrics that measure time, or how the machinery coped (a server taken out of rotation, a request sent
# again), not learning: they differ between runs that learn the same
TIMING = (
    "time",
    "time/",
    "train/tokens_per_s",
    "sft/tokens_per_s",
    "rollout/throughput_tok_s",
    "inference/failovers",
    "inference/retried_requests",
    "env_workers/",
)


def learning_metrics(metrics_file: Path) -> list[dict]:
    """The rows of a metrics JSONL file without their timing keys: equal between runs that compute the
    same."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_jsonl(metrics_file)]
