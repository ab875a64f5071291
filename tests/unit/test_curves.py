"""The JSONL -> CSV exporter behind the DVC plots (`asyncrl curves`, asyncrl.monitor.curves)."""

import json

import pytest

from asyncrl.monitor.curves import cli, curve_rows, load_metrics, to_csv

SOURCES = {
    "orchestrator": [
        {"step": 1, "time": 5.0, "rollout/reward_mean": 0.5, "async/staleness": 1},
        {"step": 0, "time": 4.0, "rollout/reward_mean": 0.25, "async/staleness": 0},
    ],
    "trainer": [{"step": 0, "time": 4.5, "train/loss": -0.125, "async/staleness": 0}],
}


def test_rows_join_processes_by_step_in_step_order():
    rows = curve_rows(SOURCES, ["rollout/reward_mean", "train/loss", "trainer:async/staleness"])
    assert rows == [
        {"step": 0, "rollout/reward_mean": 0.25, "train/loss": -0.125, "trainer:async/staleness": 0},
        # the trainer has not logged step 1: empty cells, not a dropped row
        {"step": 1, "rollout/reward_mean": 0.5, "train/loss": None, "trainer:async/staleness": None},
    ]


def test_csv_is_byte_stable_and_keeps_full_float_precision():
    rows = curve_rows(SOURCES, ["rollout/reward_mean", "train/loss"])
    text = to_csv(rows, ["step", "rollout/reward_mean", "train/loss"])
    assert text == "step,rollout/reward_mean,train/loss\n0,0.25,-0.125\n1,0.5,\n"
    value = 0.1 + 0.2  # 0.30000000000000004: a rounded format would lose it
    assert to_csv([{"step": 0, "x": value}], ["step", "x"]).splitlines()[1] == f"0,{value!r}"


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            ["async/staleness"],
            "is logged by ['orchestrator', 'trainer']; name one, e.g. orchestrator:async/staleness",
        ),
        (["train/lss"], "curve key 'train/lss' is in none of ['orchestrator', 'trainer']; logged keys: "),
        (["critic:train/loss"], "no critic.jsonl"),
        (["trainer:rollout/reward_mean"], "trainer.jsonl never logs 'rollout/reward_mean'"),
        ([], "name at least one curve key"),
    ],
)
def test_bad_keys_fail_naming_the_key(keys, message):
    with pytest.raises(ValueError) as e:
        curve_rows(SOURCES, keys)
    assert message in str(e.value)


def test_main_writes_the_csv_from_a_metrics_dir(tmp_path, capsys):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    for process, rows in SOURCES.items():
        (metrics / f"{process}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert set(load_metrics(metrics)) == {"orchestrator", "trainer"}
    out = metrics / "curves.csv"
    assert cli([str(metrics), str(out), "rollout/reward_mean"]) == 0
    assert out.read_text() == "step,rollout/reward_mean\n0,0.25\n1,0.5\n"
    assert cli([str(metrics), str(out), "train/lss"]) == 2
    assert "train/lss" in capsys.readouterr().err
    assert cli([str(tmp_path / "nowhere"), str(out), "train/loss"]) == 2
    assert "no metrics files (*.jsonl) in" in capsys.readouterr().err
