import json
import time

from asyncrl.config.run import MonitorConfig, WandbConfig
from asyncrl.monitor import build_monitor, read_jsonl, wandb_offline_note


def test_jsonl_is_always_on_and_resume_drops_later_steps(tmp_path):
    path = tmp_path / "metrics" / "trainer.jsonl"
    m = build_monitor(MonitorConfig(), path, "trainer")
    for step in range(5):
        m.log({"train/loss": float(step)}, step)
    m.close()
    m = build_monitor(MonitorConfig(), path, "trainer", resume_step=3)
    m.log({"train/loss": 30.0}, 3)
    m.close()
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["train/loss"] == 30.0
    assert all("time" in r for r in rows)


def test_wandb_offline_without_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = MonitorConfig(wandb=WandbConfig(enabled=True, project="asyncrl-test", mode="auto"))
    m = build_monitor(cfg, tmp_path / "metrics" / "orchestrator.jsonl", "orchestrator", config={"seed": 0})
    m.log({"rollout/reward_mean": 0.5}, 0)
    m.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (
        json.loads((tmp_path / "metrics" / "orchestrator.jsonl").read_text())["rollout/reward_mean"] == 0.5
    )
    # where the offline run is and how to upload it, as the launcher and `asyncrl sft` print it
    assert wandb_offline_note(
        cfg, tmp_path
    ) == f"W&B runs offline: its runs are in {runs[0]}; upload them with " + (f"`wandb sync {runs[0]}`")


def test_the_offline_note_names_the_pattern_before_the_runs_exist_and_nothing_when_online(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = MonitorConfig(wandb=WandbConfig(enabled=True, mode="auto"))
    assert f"`wandb sync {tmp_path}/wandb/offline-run-*`" in wandb_offline_note(cfg, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_offline_note(cfg, tmp_path) is None
    assert wandb_offline_note(MonitorConfig(), tmp_path) is None  # W&B off


def test_extras_are_due_every_interval_only_with_wandb():
    from asyncrl.config.run import LogExtrasConfig
    from asyncrl.monitor import extras_due

    on = MonitorConfig(
        wandb=WandbConfig(enabled=True, log_extras=LogExtrasConfig(interval=3, distributions=False))
    )
    assert [extras_due(on, s) for s in (0, 1, 3, 4, 6)] == [
        (True, False),
        (False, False),
        (True, False),
        (False, False),
        (True, False),
    ]
    assert extras_due(MonitorConfig(), 0) == (False, False)  # W&B off: nothing is computed


def test_wandb_runs_continue_on_resume_and_extras_are_logged(tmp_path, monkeypatch):
    """A resumed monitor continues the W&B run whose id the run directory keeps (a fresh start does not), and
    a table and histograms reach the run file."""
    from helpers.wandb_files import history, run_ids

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = MonitorConfig(wandb=WandbConfig(enabled=True, project="asyncrl-test", mode="offline"))
    path = tmp_path / "metrics" / "trainer.jsonl"
    m = build_monitor(cfg, path, "trainer")
    m.log({"train/loss": 1.0}, 0)
    m.log_extras(
        0,
        [{"prompt": "ab", "reward": 1.0}, {"prompt": "cd", "reward": 0.0}],
        {"train/entropy_hist": [0.1, 0.2]},
    )
    m.close()
    m = build_monitor(cfg, path, "trainer", resume_step=1)
    m.log({"train/loss": 2.0}, 1)
    m.close()
    m = build_monitor(cfg, path, "trainer")  # a new run in the same directory (launcher.overwrite): a new id
    m.close()
    # W&B's service process writes a run's file on its own after close() returns: wait until each holds its
    # run record (a slow machine can take seconds) before reading the ids
    deadline = time.monotonic() + 60
    while True:
        files = sorted(
            (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda f: f.stat().st_mtime
        )
        if (len(files) == 3 and all(run_ids(f) for f in files)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    ids = [(run_ids(f) or ["<no run record>"])[0] for f in files]
    assert len(files) == 3 and ids[0] == ids[1] != ids[2]
    assert (tmp_path / "wandb" / "trainer.run_id").read_text().strip() == ids[2]
    first, resumed = history(files[0]), history(files[1])
    assert [r["train/loss"] for r in first if "train/loss" in r] == [1.0] and first[0]["_step"] == 0
    assert [(r["_step"], r["train/loss"]) for r in resumed] == [(1, 2.0)]
    extras = next(r for r in first if "samples/_type" in r)
    assert extras["samples/_type"] == "table-file" and extras["samples/nrows"] == 2
    assert (
        extras["train/entropy_hist/_type"] == "histogram" and sum(extras["train/entropy_hist/values"]) == 2
    )
    table = json.loads((files[0].parent / "files" / extras["samples/path"]).read_text())
    assert table["columns"] == ["prompt", "reward"] and table["data"] == [["ab", 1.0], ["cd", 0.0]]
