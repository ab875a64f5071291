"""End-to-end `asyncrl rl` runs (three processes) from the SFT-warmed micro model."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

import helpers.metrics
from helpers.launch import asyncrl, rl_args, start_asyncrl
from helpers.metrics import read_jsonl

pytestmark = pytest.mark.slow


def learning_metrics(run_dir: Path, process: str) -> list[dict]:
    return helpers.metrics.learning_metrics(run_dir / "metrics" / f"{process}.jsonl")


def weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "weights" / f"step_{step}" / "model.safetensors"))


def test_reward_rises_and_trainer_matches_sidecar_at_step_0(setup, tmp_path):
    run = tmp_path / "rl"
    proc = asyncrl("rl", *rl_args(setup, run, "max_steps=20", "ckpt.interval=5"))
    assert proc.returncode == 0, proc.stderr
    orch = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    train = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in orch] == list(range(20)) == [r["step"] for r in train]
    rewards = [r["rollout/reward_mean"] for r in orch]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.015, f"reward did not rise: {rewards}"
    # step 0: same weights on both sides, so this is pure train/inference numerics (later steps also
    # measure the one-step policy change that async_level=1 allows)
    assert train[0]["train/mismatch_kl"] < 1e-3
    # the run directory reproduces itself and holds every hand-off
    meta = json.loads((run / "run_meta.json").read_text())
    assert {"git_sha", "git_dirty", "versions", "devices", "argv"} <= set(meta) and "torch" in meta[
        "versions"
    ]
    assert (run / "configs" / "config.yaml").exists() and (run / "configs" / "overrides.yaml").exists()
    assert all((run / "logs" / f"{p}.log").exists() for p in ("inference", "orchestrator", "trainer"))
    assert (run / "weights" / "step_20" / "STABLE").exists() and (run / "model" / "config.json").exists()
    sample = json.loads((run / "samples" / "step_0.jsonl").read_text().splitlines()[0])
    assert {"prompt", "completion", "reward", "advantage", "policy_version"} <= set(sample)
    summary = json.loads((run / "metrics" / "summary.json").read_text())
    assert summary["rl/steps"] == 20 and summary["rl/s_per_step_median"] > 0
    # ckpt.keep_last=2 (the default): of the checkpoints at 5, 10, 15 and 20, the newest two stay
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_15", "step_20"]
    # every file a run writes has the same mode (safetensors' writer makes 0600 files; hand-offs fix that)
    modes = {
        p.relative_to(run).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in run.rglob("*") if p.is_file()
    }
    assert len(set(modes.values())) == 1, modes


USER_PLUGINS = Path(__file__).resolve().parents[1] / "fixtures" / "user_plugins"


@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo", "my_loss:CappedReinforce"])
def test_each_loss_trains_end_to_end(setup, tmp_path, loss):
    """Each `trainer.loss.type` besides the default (covered above), and a user's own, through the three
    processes: finite losses, a real gradient every step, the policy moves, and at step 0 (same weights on
    both sides) no token or sequence is clipped. The policies travel by a weight transport from outside
    asyncrl; the user's variants are named by import path as a user names theirs
    (tests/fixtures/user_plugins)."""
    run = tmp_path / "rl"
    args = [
        a for a in rl_args(setup, run, "max_steps=3") if not a.startswith("orchestrator.prompts_per_step=")
    ]
    args += ["orchestrator.prompts_per_step=8", f"trainer.loss.type={loss}"]  # half the prompts: quicker
    args += ["+trainer.loss.args.cap=1.5"] if loss.startswith("my_loss") else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(USER_PLUGINS), os.environ.get("PYTHONPATH")])),
    }
    transport = ["weights.transport=my_transport:LoggedFiles", "+weights.args.log=versions.jsonl"]
    proc = asyncrl("rl", *args, *transport, env=env)
    assert proc.returncode == 0, proc.stderr
    published = [json.loads(line) for line in (run / "versions.jsonl").read_text().splitlines()]
    assert [p["version"] for p in published] == [1, 2, 3] and all(
        Path(p["path"]).is_dir() for p in published
    )
    train = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in train] == [0, 1, 2]
    assert all(abs(r["train/loss"]) < 1e3 and r["train/grad_norm"] > 0 for r in train), train
    assert train[0]["train/masked_frac"] == 0
    start = load_file(str(setup["sft_model"] / "model.safetensors"))
    end = weights(run, 3)
    assert any(not (start[k] == end[k]).all() for k in end)


def test_kl_penalty_against_the_starting_policy_adapts_and_resumes(setup, tmp_path):
    """trainer.kl on: the reference is the starting policy (KL exactly 0 at step 0, > 0 once the policy
    moved), beta follows the adaptive controller from one step to the next, and a resumed run continues with
    the beta its checkpoint held rather than the configured one."""
    from asyncrl.trainer.loss import adapt_kl_beta

    run = tmp_path / "rl"
    args = [a for a in rl_args(setup, run) if not a.startswith("orchestrator.prompts_per_step=")]
    kl = [
        "orchestrator.prompts_per_step=8",
        "trainer.kl.beta=0.5",
        "trainer.kl.target_kl=0.001",
        "ckpt.interval=2",
    ]
    first = asyncrl("rl", *args, *kl, "max_steps=2")
    assert first.returncode == 0, first.stderr
    second = asyncrl("rl", *args, *kl, "max_steps=4", "ckpt.resume=latest")
    assert second.returncode == 0, second.stderr
    train = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    assert train[0]["train/kl_ref"] == 0.0 and train[0]["train/kl_beta"] == 0.5
    assert all(r["train/kl_ref"] > 0 for r in train[1:]), train
    for prev, row in zip(train, train[1:], strict=False):  # across the resume at step 2 too
        expected = adapt_kl_beta(prev["train/kl_beta"], prev["train/kl_ref"], 0.001, 0.1)
        assert row["train/kl_beta"] == pytest.approx(expected)
    assert train[1]["train/kl_beta"] < 0.5  # step 0's KL (0) was under target


def test_difficulty_filter_and_curriculum_drop_count_and_skip(setup, tmp_path):
    """orchestrator.difficulty on, with its curriculum (skip_steps), on a 12-example split (each example
    comes back every other step): every step's rollout/filtered_<reason> equals what its groups' rewards say
    (all groups are in samples/step_n.jsonl, kept or not), the dropped ones are counted as dropped, and an
    example whose group left the bounds at step t is not drawn at steps t+1..t+skip_steps."""
    # the micro model's group means: 0.1-0.4
    data, skip, group_size, lo, hi = tmp_path / "data", 2, 16, 0.25, 0.33
    for split, n in (("train", 12), ("eval", 4)):
        src = (setup["root"] / "data" / "reverse_text" / f"{split}.jsonl").read_text().splitlines()[:n]
        (data / "reverse_text").mkdir(parents=True, exist_ok=True)
        (data / "reverse_text" / f"{split}.jsonl").write_text("\n".join(src) + "\n")
    filt = [
        "orchestrator.difficulty.enabled=true",
        f"orchestrator.difficulty.min_reward={lo}",
        f"orchestrator.difficulty.max_reward={hi}",
        "orchestrator.difficulty.min_reward_variance=0.001",
        f"orchestrator.difficulty.skip_steps={skip}",
        f"data_dir={data}",
        "orchestrator.prompts_per_step=6",
    ]
    run = tmp_path / "rl"
    args = [
        a for a in rl_args(setup, run, "max_steps=6") if not a.startswith("orchestrator.prompts_per_step=")
    ]
    proc = asyncrl("rl", *args, *filt)
    assert proc.returncode == 0, proc.stderr
    orch = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in orch] == list(range(6))
    skipped_until: dict[str, int] = {}  # example id -> last step it may not be drawn at
    for row in orch:
        lines = read_jsonl(run / "samples" / f"step_{row['step']}.jsonl")
        groups = [lines[i : i + group_size] for i in range(0, len(lines), group_size)]
        expected = {"zero_advantage": 0, "too_hard": 0, "too_easy": 0, "low_variance": 0}
        assert all(skipped_until.get(g[0]["id"], -1) < row["step"] for g in groups), (
            row["step"],
            skipped_until,
        )
        # (a step's draws all precede its records: an example may come twice in one step)
        for group in groups:
            rewards = [x["reward"] for x in group]
            mean = sum(rewards) / len(rewards)
            variance = sum((r - mean) ** 2 for r in rewards) / len(rewards)
            if max(rewards) - min(rewards) < 1e-9:
                expected["zero_advantage"] += 1
            elif mean < lo:
                expected["too_hard"] += 1
            elif mean > hi:
                expected["too_easy"] += 1
            elif variance < 0.001:
                expected["low_variance"] += 1
            if mean < lo or mean > hi:
                skipped_until[group[0]["id"]] = row["step"] + skip
        for reason in ("too_hard", "too_easy", "low_variance"):
            assert row[f"rollout/filtered_{reason}"] == expected[reason], (row, expected)
        assert row["rollout/dropped_groups"] == sum(expected.values())
    assert (
        sum(r["rollout/filtered_too_easy"] for r in orch) > 0
        and sum(r["rollout/filtered_too_hard"] for r in orch) > 0
    )
    assert all(r["rollout/dropped_groups"] < 6 for r in orch)  # and trained on the rest
    assert sum(r["rollout/curriculum_skipped"] for r in orch) > 0, orch
    assert "every example of env" not in proc.stderr  # the bound above held without the fallback


def test_resume_gives_the_same_metrics_as_a_straight_run(setup, straight, tmp_path):
    run = tmp_path / "rl"
    first = asyncrl("rl", *rl_args(setup, run, "max_steps=4", "ckpt.interval=4"))
    assert first.returncode == 0, first.stderr
    assert (run / "checkpoints" / "step_4" / "trainer" / "STABLE").exists()
    # a fresh launch into a used run_dir is refused (nothing is lost) ...
    refused = asyncrl("rl", *rl_args(setup, run, "max_steps=8"))
    assert refused.returncode == 2 and "ckpt.resume=latest" in refused.stderr
    # ... resuming continues up to the new total
    second = asyncrl("rl", *rl_args(setup, run, "max_steps=8", "ckpt.interval=4", "ckpt.resume=latest"))
    assert second.returncode == 0, second.stderr
    for process in ("orchestrator", "trainer"):
        assert learning_metrics(run, process) == learning_metrics(straight, process)
    a, b = weights(run, 8), weights(straight, 8)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bit-identical


@pytest.mark.parametrize("k", [0, 2])
def test_async_level_bound_holds(setup, straight, tmp_path, k):
    """Strict mode: step n is generated by exactly policy max(0, n-k) (k=1 is the `straight` run)."""
    runs = {1: straight}
    run = tmp_path / "rl"
    proc = asyncrl("rl", *rl_args(setup, run, "max_steps=5", f"async_level={k}", "trainer.behavior_kl=true"))
    assert proc.returncode == 0, proc.stderr
    runs[k] = run
    # trainer.behavior_kl: the samples scored again under the policy that sampled them (kept in memory); at
    # the live policy it is the loss's own mismatch_kl, behind it it leaves the policy's change out
    rows = read_jsonl(run / "metrics" / "trainer.jsonl")
    behavior = [r["train/behavior_kl"] for r in rows]
    mismatch = [r["train/mismatch_kl"] for r in rows]
    assert len(behavior) == 5 and all(abs(b) < 1 for b in behavior)  # k3 near 0 can round below it
    assert behavior[0] == mismatch[0]
    if k > 0:
        assert all(b != m for b, m in zip(behavior[1:], mismatch[1:], strict=True))
    for level, path in runs.items():
        for process in ("orchestrator", "trainer"):
            stale = [r["async/staleness"] for r in read_jsonl(path / "metrics" / f"{process}.jsonl")]
            assert stale == [min(n, level) for n in range(len(stale))]


def test_same_seed_same_bits_and_behavior_kl_or_profiling_change_nothing_they_measure(
    setup, straight, tmp_path
):
    """The seed and the config decide every bit: a second run learns as `straight` did, metric for metric and
    bit for bit, and another seed does not. The second run also sets trainer.behavior_kl, which swaps kept
    policies in and out for a forward, and profiles a step (trainer.profile_step): they must change nothing
    but add their own metric and files."""
    run = tmp_path / "rl"
    extra = ("max_steps=8", "ckpt.interval=4", "trainer.behavior_kl=true", "trainer.profile_step=2")
    proc = asyncrl("rl", *rl_args(setup, run, *extra))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "profile" / "step_2_rank0.json").read_text())
    assert summary["step"] == 2 and summary["comm_s"] == 0.0  # one CPU rank: no collectives, no GPU work
    assert "aten::" in (run / "profile" / "step_2_rank0_ops.txt").read_text()
    assert (run / "profile" / "step_2_rank0_trace.json.gz").stat().st_size > 0
    rows = learning_metrics(run, "trainer")
    assert all("train/behavior_kl" in r for r in rows)
    assert [{k: v for k, v in r.items() if k != "train/behavior_kl"} for r in rows] == learning_metrics(
        straight, "trainer"
    )
    assert learning_metrics(run, "orchestrator") == learning_metrics(straight, "orchestrator")
    a, b = weights(run, 8), weights(straight, 8)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    other = asyncrl("rl", *rl_args(setup, tmp_path / "seed1", "max_steps=2", "seed=1"))
    assert other.returncode == 0
    assert (
        learning_metrics(tmp_path / "seed1", "orchestrator")[0]
        != learning_metrics(straight, "orchestrator")[0]
    )


@pytest.fixture(scope="module")
def two_sidecars_non_strict(setup, tmp_path_factory) -> Path:
    """6 steps, non-strict async at k=1, on two CPU sidecars: one run for the two tests below, whose checks
    (staleness within k; both sidecars served) each hold whatever the other's setting."""
    run = tmp_path_factory.mktemp("two_sidecars_non_strict") / "rl"
    extra = ("max_steps=6", "strict_async=false", "async_level=1", "inference.gpus=['','']")
    proc = asyncrl("rl", *rl_args(setup, run, *extra))
    assert proc.returncode == 0, proc.stderr
    return run


def test_non_strict_staleness_stays_within_k(two_sidecars_non_strict):
    run = two_sidecars_non_strict
    stale = [r["async/staleness"] for r in read_jsonl(run / "metrics" / "orchestrator.jsonl")]
    assert stale[0] == 0 and all(0 <= s <= 1 for s in stale)


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def start_endless_run(setup, run: Path, trained_steps: int, log: Path):
    """`asyncrl rl` with no end in sight, its output in ``log``, returned once the trainer has logged
    ``trained_steps`` steps."""
    launcher = start_asyncrl("rl", *rl_args(setup, run, "max_steps=10000"), log=log)
    metrics = run / "metrics" / "trainer.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(read_jsonl(metrics)) >= trained_steps):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            launcher.wait()
            raise AssertionError(f"run did not reach {trained_steps} steps: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    return launcher


def test_eval_writes_metrics(setup, tmp_path):
    out = tmp_path / "eval"
    proc = asyncrl(
        "eval",
        *setup["common"],
        f"model.name={setup['sft_model']}",
        f"eval.out_dir={out}",
        "eval.n=4",
        "orchestrator.max_tokens=10",
    )
    assert proc.returncode == 0, proc.stderr
    m = json.loads((out / "metrics.json").read_text())
    for key in (
        "greedy/reward_mean",
        "sampled/reward_mean",
        "reverse_text/sampled/pass@1",
        "reverse_text/sampled/pass@4",
    ):
        assert 0.0 <= m[key] <= 1.0
    assert m["reverse_text/num_examples"] == 24
    assert m["reverse_text/sampled/pass@4"] >= m["reverse_text/sampled/pass@1"]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 24 * 5


def test_sft_loss_fell(setup):
    rows = read_jsonl(setup["sft_model"].parent / "metrics" / "sft.jsonl")
    assert len(rows) == 100
    assert sum(r["sft/loss"] for r in rows[-10:]) < 0.7 * sum(r["sft/loss"] for r in rows[:10])


def test_ctrl_c_stops_every_process(setup, tmp_path):
    run = tmp_path / "rl"
    launcher = start_endless_run(setup, run, trained_steps=1, log=tmp_path / "launcher.log")
    try:
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the launcher
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130
    assert (
        "interrupted: stopping inference, orchestrator, trainer" in (tmp_path / "launcher.log").read_text()
    )
    assert _pids(str(run / "configs" / "config.yaml")) == []


def test_two_sidecars_share_the_rollouts(two_sidecars_non_strict):
    run = two_sidecars_non_strict
    last = read_jsonl(run / "metrics" / "orchestrator.jsonl")[-1]
    assert last["inference/server0_requests"] > 0 and last["inference/server1_requests"] > 0
    assert (run / "logs" / "inference0.log").exists() and (run / "logs" / "inference1.log").exists()
