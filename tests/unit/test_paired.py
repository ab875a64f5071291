"""experiments/paired.py compares two evals' sampled rewards task by task, on the tasks both hold."""

import json

import pytest

from helpers.scripts import load_script

paired = load_script("experiments/paired.py")


def write_eval(path, rewards: dict[str, list[float]], greedy: float = 1.0) -> None:
    path.mkdir()
    rows = [{"id": task, "mode": "greedy", "reward": greedy} for task in rewards]
    rows += [{"id": task, "mode": "sampled", "reward": r} for task, rs in rewards.items() for r in rs]
    (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_differences_are_per_task_on_the_shared_tasks_and_greedy_episodes_are_left_out(tmp_path, capsys):
    write_eval(tmp_path / "a", {"t1": [0, 0], "t2": [1, 0], "t3": [1, 1], "only_a": [0, 0]}, greedy=0.0)
    write_eval(tmp_path / "b", {"t1": [1, 0], "t2": [1, 1], "t3": [1, 1], "only_b": [1, 1]})
    s = paired.paired(paired.task_means(tmp_path / "a"), paired.task_means(tmp_path / "b"))
    assert (s["tasks"], s["up"], s["down"], s["same"]) == (3, 2, 0, 1)
    assert s["before"] == pytest.approx(0.5) and s["after"] == pytest.approx(5 / 6)
    assert s["diff"] == pytest.approx(1 / 3) and s["se"] == pytest.approx((1 / 12) ** 0.5 / 3**0.5)
    assert 0 <= s["ci_low"] <= s["diff"] <= s["ci_high"] <= 0.5
    assert paired.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "3 tasks: sampled reward 0.500" in capsys.readouterr().out


def test_evals_with_fewer_than_two_tasks_in_common_are_refused(tmp_path):
    write_eval(tmp_path / "a", {"t1": [0.0]})
    write_eval(tmp_path / "b", {"t2": [1.0]})
    with pytest.raises(SystemExit, match="0 task"):
        paired.paired(paired.task_means(tmp_path / "a"), paired.task_means(tmp_path / "b"))
