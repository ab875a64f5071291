"""asyncrl.analysis: run-directory loaders, the `dvc exp show --json` parser and the notebook figures, on
hand-written inputs with hand-computed answers (the notebooks' end-to-end test is tests/integration)."""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")  # no display here or in CI

import pandas as pd
import pytest

from asyncrl.analysis import experiments as ex
from asyncrl.analysis import plots, runs
from asyncrl.monitor import JsonlMonitor
from asyncrl.paths import RunDir


def write_metrics(run: RunDir, process: str, rows: list[dict]) -> None:
    """Through the monitor the processes use, so the loader reads the format that is really written."""
    mon = JsonlMonitor(run.metrics_file(process))
    for row in rows:
        mon.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    mon.close()


def write_samples(run: RunDir, step: int, rows: list[tuple[str, str, float, float]]) -> None:
    run.samples.mkdir(parents=True, exist_ok=True)
    run.samples_step(step).write_text(
        "".join(
            json.dumps(
                {
                    "step": step,
                    "env": "e",
                    "id": f"x{i}",
                    "prompt": p,
                    "completion": c,
                    "reward": r,
                    "advantage": a,
                    "finish_reason": "stop",
                    "policy_version": max(step - 1, 0),
                    "completion_tokens": len(c),
                }
            )
            + "\n"
            for i, (p, c, r, a) in enumerate(rows)
        )
    )


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "rl").create()
    write_metrics(
        run,
        "orchestrator",
        [
            {"step": 0, "rollout/reward_mean": 0.5, "rollout/reward_std": 0.1, "async/staleness": 0},
            {"step": 1, "rollout/reward_mean": 0.6, "rollout/reward_std": 0.1, "async/staleness": 1},
            {"step": 2, "rollout/reward_mean": 0.7, "rollout/reward_std": 0.2, "async/staleness": 1},
        ],
    )
    # the trainer is one step behind (async_level=1, run still going)
    write_metrics(
        run,
        "trainer",
        [
            {"step": 0, "train/loss": -0.1, "train/mismatch_kl": 0.0, "async/staleness": 0},
            {"step": 1, "train/loss": -0.2, "train/mismatch_kl": 0.01, "async/staleness": 1},
        ],
    )
    write_samples(run, 0, [("ab", "ba", 1.0, 0.5), ("ab", "aa", 0.0, -0.5)])
    write_samples(
        run,
        2,
        [
            ("cd", "dc", 1.0, 0.3),
            ("cd", "d", 0.5, -0.2),
            ("cd", "x", 0.0, -0.7),
            ("ef", "fe", 1.0, 0.4),
            ("ef", "e", 0.5, 0.0),
            ("ef", "y", 0.0, -0.4),
        ],
    )
    write_samples(run, 10, [("gh", "hg", 0.9, 0.0)])
    return run


# -- run directory --------------------------------------------------------------------------------------


def test_load_metrics_joins_processes_by_step(run):
    m = runs.load_metrics(run.root)
    assert m.index.tolist() == [0, 1, 2]
    assert m["rollout/reward_mean"].tolist() == [0.5, 0.6, 0.7]
    assert m["train/loss"].tolist()[:2] == [-0.1, -0.2] and math.isnan(m.loc[2, "train/loss"])
    # a key both log: the orchestrator's under its name, the trainer's suffixed
    assert m["async/staleness"].tolist() == [0, 1, 1]
    assert m["async/staleness@trainer"].tolist()[:2] == [0, 1]
    assert {"time", "time@trainer"} <= set(m.columns)


def test_load_metrics_keeps_the_last_row_of_a_step_and_skips_a_half_written_line(run):
    path = run.metrics_file("orchestrator")
    path.write_text(
        path.read_text() + json.dumps({"step": 2, "rollout/reward_mean": 0.9}) + '\n{"step": 3, "rol'
    )
    m = runs.load_process_metrics(run.root, "orchestrator")
    assert m.index.tolist() == [0, 1, 2] and m.loc[2, "rollout/reward_mean"] == 0.9


def test_a_wrong_run_dir_fails_naming_the_missing_path(run, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"run directory not found: {tmp_path / 'nope'}"):
        runs.load_metrics(tmp_path / "nope")
    run.metrics_file("trainer").unlink()
    with pytest.raises(FileNotFoundError, match="trainer metrics not found: .*metrics/trainer.jsonl"):
        runs.load_metrics(run.root)
    with pytest.raises(FileNotFoundError, match="samples directory not found: .*save_samples=false"):
        runs.load_samples(RunDir(tmp_path / "empty").create().root)
    with pytest.raises(ValueError, match="process='sidecar'"):
        runs.load_process_metrics(run.root, "sidecar")


def test_load_samples_orders_steps_numerically(run):
    (run.samples / "step_notes.jsonl").write_text('{"step": 99}\n')  # not a step file: ignored
    s = runs.load_samples(run.root)
    assert list(s.columns[: len(runs.SAMPLE_COLUMNS)]) == runs.SAMPLE_COLUMNS
    assert s["step"].tolist() == [0, 0] + [2] * 6 + [10]  # step_10 after step_2, not between 1 and 2
    assert s[s["step"] == 2]["completion"].tolist() == ["dc", "d", "x", "fe", "e", "y"]  # written order kept


def test_best_and_worst_per_step(run):
    s = runs.load_samples(run.root)
    bw = runs.best_and_worst(s, k=2)
    got = [(r.step, r.rank, r.completion) for r in bw.itertuples()]
    assert got == [
        (0, "best", "ba"),
        (0, "best", "aa"),  # two samples: both are best, none is left for worst
        (2, "best", "dc"),
        (2, "best", "fe"),
        (2, "worst", "x"),
        (2, "worst", "y"),  # ties: first written wins
        (10, "best", "hg"),
    ]
    assert list(bw.columns[:2]) == ["step", "rank"] and {"prompt", "reward", "advantage"} <= set(bw.columns)
    one = runs.best_and_worst(s, k=1, steps=[2])
    assert [(r.rank, r.completion, r.reward, r.advantage) for r in one.itertuples()] == [
        ("best", "dc", 1.0, 0.3),
        ("worst", "x", 0.0, -0.7),
    ]
    assert runs.best_and_worst(s, steps=[5]).empty
    with pytest.raises(ValueError, match="k=0"):
        runs.best_and_worst(s, k=0)


@pytest.mark.parametrize(
    "steps, n, want",
    [
        (list(range(10)), 3, [0, 4, 9]),  # round(4.5) = 4: banker's rounding, still spread
        (list(range(10)), 1, [9]),
        ([3, 1, 2, 2], 5, [1, 2, 3]),
        (list(range(300)), 5, [0, 75, 150, 224, 299]),
        ([], 3, []),
    ],
)
def test_spread_steps(steps, n, want):
    assert runs.spread_steps(steps, n) == want


def test_run_info_reads_config_meta_and_summary(run):
    run.config_file.write_text(
        "model: {name: m}\nenv: {reverse_text: {}}\nmax_steps: 3\nasync_level: 1\n"
        "orchestrator: {group_size: 4}\ntrainer: {loss: {type: grpo}}\n"
    )
    run.meta_file.write_text(json.dumps({"git_sha": "abc", "git_dirty": False}))
    info = runs.run_info(run.root)
    assert info["model"] == "m" and info["env"] == "reverse_text" and info["async_level"] == 1
    assert (
        info["orchestrator.group_size"] == 4
        and info["trainer.loss.type"] == "grpo"
        and info["git_sha"] == "abc"
    )
    assert "rl/steps" not in info
    (run.metrics / "summary.json").write_text(json.dumps({"rl/steps": 3}))
    assert runs.run_info(run.root)["rl/steps"] == 3


# -- dvc exp show --json ------------------------------------------------------------------------------------


def state(rev: str, name: str | None, lr: float, reward: float | None, **extra) -> dict:
    metrics = {} if reward is None else {"metrics.json": {"data": {"reward": reward, "eval": {"n": 10}}}}
    return {
        "rev": rev,
        "name": name,
        "error": None,
        "experiments": None,
        "data": {
            "rev": rev,
            "timestamp": "2026-11-22T03:13:17",
            "deps": {},
            "outs": {},
            "meta": {},
            "params": {"params.yaml": {"data": {"train": {"lr": lr, "opt": "adam"}, "seed": 0}}},
            "metrics": metrics,
        },
        **extra,
    }


# shaped like DVC 3.67's output (tests/integration runs the real one)
EXP_SHOW = [
    state("workspace", None, 0.5, 0.5),
    {
        **state("b" * 40, "main", 0.1, 0.9),
        "experiments": [
            {"name": "big-lr", "executor": None, "revs": [state("a" * 40, "big-lr", 0.5, 0.5)]},
            {
                "name": "queued-one",
                "executor": {"state": "queued", "name": None, "local": None},
                "revs": [
                    {"rev": "c" * 40, "name": "queued-one", "data": None, "error": None, "experiments": None}
                ],
            },
            {
                "name": "broken",
                "executor": {"state": "failed", "name": "workspace", "local": None},
                "revs": [
                    state(
                        "d" * 40,
                        "broken",
                        0.3,
                        None,
                        error={"msg": "stage 'eval' failed", "type": "ReproductionError"},
                    )
                ],
            },
        ],
    },
]


def test_parse_exp_show_flattens_baselines_and_experiments():
    recs = ex.parse_exp_show(EXP_SHOW)
    assert [(r.name, r.rev, r.baseline, r.state) for r in recs] == [
        ("main", "b" * 7, "main", "baseline"),
        ("big-lr", "a" * 7, "main", "success"),
        ("queued-one", "c" * 7, "main", "queued"),
        ("broken", "d" * 7, "main", "failed"),
    ]
    assert recs[1].params == {"train.lr": 0.5, "train.opt": "adam", "seed": 0}
    assert recs[1].metrics == {"reward": 0.5, "eval.n": 10}
    assert recs[2].params == {} and recs[2].error is None
    assert recs[3].error == "ReproductionError: stage 'eval' failed"
    assert [r.name for r in ex.parse_exp_show(EXP_SHOW, workspace=True)][0] == "workspace"


def test_a_key_in_two_files_is_prefixed_with_its_file():
    base = state("b" * 40, "main", 0.1, 0.9)
    base["data"]["metrics"]["other.json"] = {
        "data": {"reward": 0.2, "only_here": 1},
        "error": {"type": "YAMLError", "msg": "bad"},
    }
    (rec,) = ex.parse_exp_show([base])
    assert rec.metrics == {
        "metrics.json:reward": 0.9,
        "eval.n": 10,
        "other.json:reward": 0.2,
        "only_here": 1,
    }
    assert rec.error == "other.json: YAMLError: bad"


def test_parse_exp_show_rejects_other_json():
    with pytest.raises(ValueError, match="expected a list of baselines"):
        ex.parse_exp_show({"workspace": {}})
    with pytest.raises(ValueError, match="without 'rev'"):
        ex.parse_exp_show([{"name": "x"}])


def test_experiments_table_keeps_changed_params_and_all_metrics():
    table = ex.experiments_table(ex.parse_exp_show(EXP_SHOW))
    assert table.index.tolist() == ["main", "big-lr", "queued-one", "broken"]
    # train.opt and seed are the same (queued: not known)
    assert list(table["params"].columns) == ["train.lr"]
    assert table.loc["queued-one", ("info", "state")] == "queued"
    assert math.isnan(table.loc["queued-one", ("params", "train.lr")])
    done = ex.experiments_table([r for r in ex.parse_exp_show(EXP_SHOW) if r.state != "queued"])
    assert list(done["params"].columns) == ["train.lr"]
    assert done[("params", "train.lr")].tolist() == [0.1, 0.5, 0.3]
    assert list(done["metrics"].columns) == ["reward", "eval.n"]
    assert done[("metrics", "reward")].tolist()[:2] == [0.9, 0.5]
    assert math.isnan(done.loc["broken", ("metrics", "reward")])
    assert done.loc["broken", ("info", "state")] == "failed"
    single = ex.experiments_table(ex.parse_exp_show(EXP_SHOW)[:1])
    # a single row keeps every param
    assert list(single["params"].columns) == ["train.lr", "train.opt", "seed"]
    assert ex.numeric_columns(done, "params") == ["train.lr"]
    assert ex.numeric_columns(done, "metrics") == ["reward", "eval.n"]
    with pytest.raises(ValueError, match="no experiments"):
        ex.experiments_table([])


def test_choose():
    assert ex.choose(["a", "b"]) == "a"
    assert ex.choose(["a", "b"], preferred=("z", "b")) == "b"
    assert ex.choose(["a", "b"], "a", preferred=("b",)) == "a"
    with pytest.raises(ValueError, match="metric 'c' is not one of"):
        ex.choose(["a", "b"], "c", what="metric")
    with pytest.raises(ValueError, match="no numeric param to choose from: no experiment has one yet"):
        ex.choose([], what="param")
    # a key two eval files share is named file:key; the RL eval's is preferred over the SFT eval's
    shared = [
        "out/eval_sft/metrics.json:greedy/reward_mean",
        "out/eval_rl/metrics.json:greedy/reward_mean",
        "x",
    ]
    assert ex.choose(shared, preferred=("greedy/reward_mean",)) == shared[1]
    assert ex.choose(shared[:1] + ["x"], preferred=("greedy/reward_mean",)) == shared[0]
    per_env = ["reverse_text/greedy/reward_mean", "greedy/reward_mean"]  # one environment's is not the mean
    assert ex.choose(per_env, preferred=("greedy/reward_mean",)) == "greedy/reward_mean"


def test_exp_show_outside_a_dvc_repo_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"not a DVC repository .*{tmp_path}"):
        ex.exp_show(tmp_path)


# -- figures ------------------------------------------------------------------------------------------------


def test_run_curves_draw_the_logged_metrics(run):
    fig = plots.plot_run_curves(runs.load_metrics(run.root))
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [t for t, _, _ in plots.CURVES]
    assert axes[0].lines[0].get_ydata().tolist() == [0.5, 0.6, 0.7]
    assert axes[1].lines[0].get_ydata().tolist() == [-0.1, -0.2]  # the trainer's missing step is not drawn
    assert axes[3].lines[0].get_ydata().tolist() == [0, 1, 1]
    smooth = plots.plot_run_curves(runs.load_metrics(run.root), smooth=2)
    assert smooth.axes[0].lines[1].get_ydata().tolist() == pytest.approx([0.5, 0.55, 0.65])
    with pytest.raises(ValueError, match="smooth=0"):
        plots.plot_run_curves(pd.DataFrame(), smooth=0)


def test_run_curves_say_which_metric_was_not_logged():
    fig = plots.plot_run_curves(pd.DataFrame({"rollout/reward_mean": [0.1, 0.2]}))
    assert [t.get_text() for t in fig.axes[1].texts] == ["train/loss: not logged"]


def test_metric_vs_param_plots_experiments_in_param_order():
    table = ex.experiments_table([r for r in ex.parse_exp_show(EXP_SHOW) if r.state != "queued"])
    ax = plots.plot_metric_vs_param(table, "train.lr", "reward")
    line = ax.lines[0]
    # no metric: left out
    assert line.get_xdata().tolist() == [0.1, 0.5] and line.get_ydata().tolist() == [0.9, 0.5]
    assert [t.get_text() for t in ax.texts] == ["main", "big-lr"]
    with pytest.raises(KeyError, match=r"params has no 'lr'; it has \['train.lr'\]"):
        plots.plot_metric_vs_param(table, "lr", "reward")
