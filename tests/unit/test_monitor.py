import json

from asyncrl.config.sections import MonitorConfig, WandbConfig
from asyncrl.monitor import build_monitor, read_jsonl


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
    assert json.loads((tmp_path / "metrics" / "orchestrator.jsonl").read_text())["rollout/reward_mean"] == 0.5
