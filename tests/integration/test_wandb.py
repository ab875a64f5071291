"""W&B offline, end to end, read back from its run files: every step's scalars, the samples table and the
histograms every `log_extras.interval` steps from both processes, a resumed run continuing the same two W&B
runs, and an eval logged to the same project."""

from __future__ import annotations

import json

from helpers.launch import asyncrl, rl_args
from helpers.metrics import read_jsonl
from helpers.wandb_files import history, records, run_ids

WANDB = [
    "monitor.wandb.enabled=true",
    "monitor.wandb.mode=offline",
    "monitor.wandb.project=asyncrl-test",
    "monitor.wandb.log_extras.interval=2",
    "monitor.wandb.log_extras.max_samples=6",
]


def runs_of(run_dir, process):
    """The .wandb files of ``process`` in ``run_dir``, oldest first (one per start of the process)."""
    files = [f for f in (run_dir / "wandb").glob("offline-run-*/run-*.wandb") if process in _name(f)]
    return sorted(files, key=lambda f: f.stat().st_mtime)


def _name(path):
    return next(r.run.display_name for r in records(path) if r.WhichOneof("record_type") == "run")


def test_wandb_tables_histograms_and_resumed_runs(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "rl"
    args = [a for a in rl_args(setup, run) if not a.startswith("orchestrator.prompts_per_step=")]
    args += ["orchestrator.prompts_per_step=4", *WANDB, "ckpt.interval=2"]
    assert asyncrl("rl", *args, "max_steps=2").returncode == 0
    proc = asyncrl("rl", *args, "max_steps=4", "ckpt.resume=latest")
    assert proc.returncode == 0, proc.stderr
    # the launcher names the offline runs and how to upload them
    offline = " ".join(sorted(str(p) for p in (run / "wandb").glob("offline-run-*")))
    assert f"W&B runs offline: its runs are in {offline}; upload them with `wandb sync {offline}`" in (
        proc.stdout + proc.stderr
    )
    for process, hist in (("orchestrator", "rollout/reward_hist"), ("trainer", "train/entropy_hist")):
        first, resumed = runs_of(run, process)
        assert run_ids(first) == run_ids(resumed)  # the same W&B run, continued
        rows = history(first) + history(resumed)
        jsonl = read_jsonl(run / "metrics" / f"{process}.jsonl")
        key = "rollout/reward_mean" if process == "orchestrator" else "train/loss"
        assert [(r["_step"], r[key]) for r in rows if key in r] == [(r["step"], r[key]) for r in jsonl]
        assert [r["_step"] for r in rows if f"{hist}/_type" in r] == [0, 2]  # interval 2
    # the samples table of step 2 is the step's rollouts (in samples/step_2.jsonl), spread over its 4 groups
    orch = [r for f in runs_of(run, "orchestrator") for r in history(f)]
    extras = next(r for r in orch if r["_step"] == 2 and "samples/path" in r)
    table_file = next(run.glob(f"wandb/offline-run-*/files/{extras['samples/path']}"))
    table = json.loads(table_file.read_text())
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) == 6 and len({r["id"] for r in rows}) == 4
    assert {"prompt", "completion", "reward", "advantage", "policy_version", "env"} <= set(table["columns"])
    samples = {(s["id"], s["completion"]): s for s in read_jsonl(run / "samples" / "step_2.jsonl")}
    for r in rows:
        s = samples[(r["id"], r["completion"])]
        assert (r["reward"], r["advantage"], r["policy_version"]) == (
            s["reward"],
            s["advantage"],
            s["policy_version"],
        )
    trainer = [r for f in runs_of(run, "trainer") for r in history(f)]
    ratio = next(r for r in trainer if "train/ratio_hist/_type" in r)
    assert (
        sum(ratio["train/ratio_hist/values"])
        == read_jsonl(run / "metrics" / "trainer.jsonl")[0]["train/loss_tokens"]
    )

    # an eval logs its metrics and samples to the same project
    out = tmp_path / "eval"
    ev = asyncrl(
        "eval",
        *setup["common"],
        f"model.name={run / 'model'}",
        f"eval.out_dir={out}",
        "eval.num_examples=4",
        "eval.n=2",
        *WANDB,
    )
    assert ev.returncode == 0, ev.stderr
    (eval_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    metrics = json.loads((out / "metrics.json").read_text())
    (row,) = [r for r in history(eval_file) if "eval/greedy/reward_mean" in r]
    assert row["eval/greedy/reward_mean"] == metrics["greedy/reward_mean"] and "samples/_type" in row
    runs = [r.run for r in records(eval_file) if r.WhichOneof("record_type") == "run"]
    assert runs and all(r.project == "asyncrl-test" and r.job_type == "eval" for r in runs)
