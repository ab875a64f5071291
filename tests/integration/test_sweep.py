"""``asyncrl <command> -m``: Hydra's multirun, every combination checked first, then run one after
another."""

from __future__ import annotations

import json

from helpers.launch import asyncrl, rl_args


def test_an_rl_sweep_runs_every_combination_in_its_own_directory_and_sums_them_up(setup, tmp_path):
    base = tmp_path / "sweep"
    args = rl_args(
        setup, base, "max_steps=1", "orchestrator.prompts_per_step=4", "orchestrator.group_size=4"
    )
    proc = asyncrl("rl", "-m", *args, "trainer.optim.lr=1e-3,3e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((base / "sweep.json").read_text())
    runs = record["runs"]
    assert [r["swept"] for r in runs] == [{"trainer.optim.lr": "0.001"}, {"trainer.optim.lr": "0.003"}]
    for r in runs:
        assert r["returncode"] == 0 and r["metrics"]["rl/steps"] == 1 and "rl/final_reward" in r["metrics"]
        assert (base / r["out_dir"].rsplit("/", 1)[-1] / "metrics" / "summary.json").is_file()
        config = (base / r["out_dir"].rsplit("/", 1)[-1] / "configs" / "config.yaml").read_text()
        # each run trained with its own value
        assert f"lr: {float(r['swept']['trainer.optim.lr'])}" in config
    lines = proc.stdout.splitlines()
    table = lines[
        next(i for i, line in enumerate(lines) if line.split()[:1] == ["run"] and " exit " in line) :
    ]
    assert table[0].split()[:4] == ["run", "trainer.optim.lr", "exit", "s"] and "rl/final_reward" in table[0]
    assert [line.split()[:3] for line in table[1:3]] == [["0", "0.001", "0"], ["1", "0.003", "0"]]


def test_a_sweep_is_refused_whole_when_one_combination_is_wrong(tmp_path):
    # prepare: the one command whose checks need no data prepared before
    proc = asyncrl(
        "prepare", "-m", "seed=0,1", "trainer.optim.lr=1e-3,-1", f"data_dir={tmp_path}/s", timeout=120
    )
    assert proc.returncode == 2 and "the sweep is refused, nothing ran" in proc.stderr, proc.stderr
    assert "runs 1 (0, -1), 3 (1, -1)" in proc.stderr and "trainer.optim.lr=-1" in proc.stderr
    assert "run 0" not in proc.stderr and not (tmp_path / "s").exists()
    listed = asyncrl("prepare", "--multirun", "seed=0,1", f"data_dir={tmp_path}/s", "--cfg", timeout=120)
    assert listed.returncode == 0 and f"data_dir={tmp_path}/s/1_seed-1" in listed.stdout, listed.stderr
    assert not (tmp_path / "s").exists()
    assert "-m (sweep) runs prepare, sft, rl, eval" in asyncrl("serve", "-m", "seed=0,1", timeout=60).stderr
