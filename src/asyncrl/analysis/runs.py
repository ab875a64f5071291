"""Read a run directory into tables: per-step metrics, saved samples, the best and worst samples per step.

Every loader checks the files it needs first and raises ``FileNotFoundError`` naming the missing path,
so a wrong ``run_dir`` fails on its first line rather than as an empty plot. Files are read as they are:
a run that is still going can be analysed (a half-written last line is skipped, see
:func:`asyncrl.monitor.read_jsonl`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from asyncrl.monitor import read_jsonl
from asyncrl.paths import RunDir

PROCESSES = ("orchestrator", "trainer")
_SAMPLES_RE = re.compile(r"step_(\d+)\.jsonl")
SAMPLE_COLUMNS = [
    "step",
    "env",
    "id",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "policy_version",
    "finish_reason",
    "completion_tokens",
]


def _require(path: Path, what: str, hint: str = "") -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}{' (' + hint + ')' if hint else ''}")
    return path


def _run(run_dir: str | Path) -> RunDir:
    run = RunDir(run_dir)
    _require(
        run.root, "run directory", "pass the run_dir of an `asyncrl rl` run, e.g. outputs/reverse_text/rl"
    )
    return run


def load_process_metrics(run_dir: str | Path, process: str) -> pd.DataFrame:
    """One process's ``metrics/<process>.jsonl`` as a DataFrame indexed by ``step`` (one row per step, the
    last one written wins), columns as logged (``rollout/reward_mean``, ``train/loss``, ...)."""
    if process not in PROCESSES:
        raise ValueError(f"process={process!r}: expected one of {PROCESSES}")
    run = _run(run_dir)
    path = _require(run.metrics_file(process), f"{process} metrics", "has this run started?")
    rows = read_jsonl(path)
    frame = pd.DataFrame(rows) if rows else pd.DataFrame({"step": pd.Series(dtype="int64")})
    return frame.drop_duplicates("step", keep="last").set_index("step").sort_index()


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Orchestrator and trainer metrics side by side, indexed by ``step`` (outer join: while a run goes on,
    the orchestrator is up to ``async_level`` steps ahead, so the trainer's newest cells are NaN).

    A key both processes log (``time``, ``async/staleness``) keeps the orchestrator's value under its own
    name and the trainer's under ``<key>@trainer``. Both log the same staleness: the orchestrator the
    policy it generated with, the trainer the oldest policy in the batch it consumed.
    """
    orch, train = (load_process_metrics(run_dir, p) for p in PROCESSES)
    return orch.merge(train, how="outer", left_index=True, right_index=True, suffixes=("", "@trainer"))


def load_samples(run_dir: str | Path) -> pd.DataFrame:
    """Every ``samples/step_N.jsonl`` as one DataFrame (columns :data:`SAMPLE_COLUMNS` first), sorted by
    step, in the order the orchestrator wrote them (prompt by prompt, group member by group member)."""
    run = _run(run_dir)
    _require(run.samples, "samples directory", "the run was started with orchestrator.save_samples=false?")
    files = {
        int(m.group(1)): p for p in run.samples.glob("step_*.jsonl") if (m := _SAMPLES_RE.fullmatch(p.name))
    }
    rows = [row for step in sorted(files) for row in read_jsonl(files[step])]
    frame = pd.DataFrame(rows, columns=None if rows else SAMPLE_COLUMNS)
    first = [c for c in SAMPLE_COLUMNS if c in frame.columns]
    frame = frame[first + [c for c in frame.columns if c not in first]]
    return frame.sort_values("step", kind="stable").reset_index(drop=True)


def best_and_worst(samples: pd.DataFrame, k: int = 1, steps: list[int] | None = None) -> pd.DataFrame:
    """The ``k`` highest- and ``k`` lowest-reward samples of each step (of ``steps``, default all).

    Columns: ``step``, ``rank`` (``"best"`` / ``"worst"``), then the sample's columns; per step the best
    come first (highest first), then the worst (lowest first). Among equal rewards the sample written
    first wins, so the result is deterministic. A sample is never both: with fewer than ``2k`` samples in
    a step, the worst are chosen from what is left after the best.
    """
    if k < 1:
        raise ValueError(f"k={k}: must be >= 1")
    if steps is not None:
        samples = samples[samples["step"].isin(steps)]
    parts = []
    for _, group in samples.groupby("step", sort=True):
        best = group.sort_values("reward", ascending=False, kind="stable").head(k)
        worst = group.drop(best.index).sort_values("reward", ascending=True, kind="stable").head(k)
        parts += [best.assign(rank="best"), worst.assign(rank="worst")]
    if not parts:
        return pd.DataFrame(columns=["step", "rank", *[c for c in samples.columns if c != "step"]])
    out = pd.concat(parts)
    cols = ["step", "rank", *[c for c in out.columns if c not in ("step", "rank")]]
    return out[cols].reset_index(drop=True)


def spread_steps(steps: list[int], n: int) -> list[int]:
    """``n`` of ``steps`` spread evenly, first and last included (all of them when there are ``<= n``)."""
    steps = sorted(set(steps))
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    if len(steps) <= n:
        return steps
    if n == 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)})


def run_info(run_dir: str | Path) -> dict[str, Any]:
    """What a reader wants to know first: the main config keys, the git state and the launcher's summary
    (``metrics/summary.json``, present once a run has finished)."""
    run = _run(run_dir)
    cfg = yaml.safe_load(_require(run.config_file, "resolved config").read_text())
    info: dict[str, Any] = {"run_dir": str(run.root)}
    info["model"] = cfg.get("model", {}).get("name")
    info["env"] = ",".join(cfg.get("env", {}))
    for key in ("max_steps", "async_level", "strict_async", "seed", "seq_len"):
        info[key] = cfg.get(key)
    oc = cfg.get("orchestrator", {})
    for key in ("prompts_per_step", "group_size", "temperature"):
        info[f"orchestrator.{key}"] = oc.get(key)
    info["trainer.loss.type"] = cfg.get("trainer", {}).get("loss", {}).get("type")
    if run.meta_file.exists():
        meta = json.loads(run.meta_file.read_text())
        info["git_sha"] = meta.get("git_sha")
        info["git_dirty"] = meta.get("git_dirty")
    summary = run.metrics / "summary.json"
    if summary.exists():
        info.update(json.loads(summary.read_text()))
    return info
