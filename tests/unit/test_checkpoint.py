"""Checkpoint bookkeeping on run directories laid out by hand: manifests, fallback, reconcile, pruning."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from asyncrl.checkpoint import SFT_PARTS, VERIFIED_ENV, prune_checkpoints, reconcile, resolve_resume
from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.launcher.progress import Progress
from asyncrl.paths import STABLE, RunDir
from asyncrl.utils.atomic import atomic_dir, verify_sealed


def cfg_for(run: RunDir, *extra: str):
    return compose_config([f"run_dir={run.root}", "max_steps=12", "async_level=1", *extra])


def write_step(run: RunDir, step: int, weights: bool = True) -> None:
    """What a run leaves after ``step`` steps with a checkpoint there."""
    for part in ("trainer", "orchestrator"):
        with atomic_dir(run.checkpoint(step, part), digest=True) as tmp:
            (tmp / "state.ckpt").write_bytes(os.urandom(2048))
    if weights:
        for v in (step - 1, step):
            with atomic_dir(run.weights_step(v)) as tmp:
                (tmp / "model.safetensors").write_bytes(os.urandom(512))


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run").create()
    for s in (4, 8):
        write_step(run, s)
    return run


def test_manifest_catches_truncation_and_corruption_and_keeps_modes(tmp_path):
    with atomic_dir(tmp_path / "d", digest=True) as tmp:
        (tmp / "a.bin").write_bytes(b"x" * 100)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"y" * 10)
        os.chmod(tmp / "a.bin", 0o600)  # as safetensors writes its files
    d = tmp_path / "d"
    assert verify_sealed(d) is None
    assert stat.S_IMODE((d / "a.bin").stat().st_mode) == stat.S_IMODE((d / "sub" / "b.bin").stat().st_mode)
    # readable by group and others, as the umask allows
    assert stat.S_IMODE((d / "a.bin").stat().st_mode) & 0o044
    with (d / "a.bin").open("r+b") as f:
        f.truncate(50)
    assert "truncated" in verify_sealed(d)
    (d / "a.bin").write_bytes(b"z" * 100)  # same size, other bytes
    assert "corrupt" in verify_sealed(d)
    (d / "a.bin").unlink()
    assert "missing" in verify_sealed(d)
    (d / STABLE).unlink()
    assert "no STABLE" in verify_sealed(d)
    (d / STABLE).touch()  # a marker without a manifest (an older run directory): complete, nothing to check
    assert verify_sealed(d) is None


def test_latest_skips_a_truncated_checkpoint_with_a_log_line(run, caplog):
    assert resolve_resume(cfg_for(run, "ckpt.resume=latest"), run) == 8
    with run.checkpoint(8, "trainer").joinpath("state.ckpt").open("r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(cfg_for(run, "ckpt.resume=latest"), run) == 4
    assert "skipping checkpoint step 8" in caplog.text and "state.ckpt" in caplog.text
    # asked for by number: an error, not a skip
    with pytest.raises(ConfigError, match="ckpt.resume=8.*truncated"):
        resolve_resume(cfg_for(run, "ckpt.resume=8"), run)


def test_a_step_the_parent_verified_is_checked_by_size_only(run, monkeypatch):
    state = run.checkpoint(8, "trainer") / "state.ckpt"
    state.write_bytes(b"z" * state.stat().st_size)  # same size, other bytes: only a digest sees it
    with pytest.raises(ConfigError, match="corrupt"):
        resolve_resume(cfg_for(run, "ckpt.resume=8"), run)
    monkeypatch.setenv(VERIFIED_ENV, str(run.checkpoint(8).resolve()))
    assert resolve_resume(cfg_for(run, "ckpt.resume=8"), run) == 8  # the launcher hashed it a moment ago
    state.write_bytes(b"short")
    with pytest.raises(ConfigError, match="truncated"):  # sizes are still checked
        resolve_resume(cfg_for(run, "ckpt.resume=8"), run)
    monkeypatch.setenv(VERIFIED_ENV, str(run.checkpoint(4).resolve()))  # another step: no shortcut
    state.write_bytes(b"z" * 2048)
    with pytest.raises(ConfigError, match="corrupt"):
        resolve_resume(cfg_for(run, "ckpt.resume=8"), run)


def test_sft_checkpoints_have_one_part_and_resume_the_same_way(tmp_path, caplog):
    run = RunDir(tmp_path / "sft").create()
    for step in (10, 20, 30):
        with atomic_dir(run.checkpoint(step, "trainer"), digest=True) as tmp:
            (tmp / "state.ckpt").write_bytes(os.urandom(1024))
    cfg = compose_config([f"sft.run_dir={run.root}", "sft.max_steps=40", "ckpt.resume=latest"])
    assert resolve_resume(cfg, run, sft=True) == 30
    with pytest.raises(ConfigError, match="no complete checkpoint"):  # an RL resume needs both parts
        resolve_resume(cfg, run)
    (run.checkpoint(30, "trainer") / "state.ckpt").write_bytes(b"cut")
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(cfg, run, sft=True) == 20
    assert "skipping checkpoint step 30" in caplog.text
    assert prune_checkpoints(run, 2, SFT_PARTS) == [10]
    with pytest.raises(ConfigError, match="past sft.max_steps=15"):
        resolve_resume(
            compose_config([f"sft.run_dir={run.root}", "sft.max_steps=15", "ckpt.resume=20"]), run, sft=True
        )


def test_a_checkpoint_whose_weights_are_damaged_is_skipped(run):
    (run.weights_step(7) / "model.safetensors").write_bytes(b"short")
    assert resolve_resume(cfg_for(run, "ckpt.resume=latest"), run) == 4
    # async_level=0 needs policy 8 only
    assert (
        resolve_resume(cfg_for(run, "ckpt.resume=latest", "async_level=0", "trainer.keep_weights=2"), run)
        == 8
    )


def test_no_usable_checkpoint_is_an_error_listing_each(run):
    for s in (4, 8):
        (run.checkpoint(s, "orchestrator") / "state.ckpt").unlink()
    with pytest.raises(ConfigError, match=r"no usable checkpoint(.|\n)*step 8(.|\n)*step 4"):
        resolve_resume(cfg_for(run, "ckpt.resume=latest"), run)


def test_reconcile_cuts_the_run_back_to_the_checkpoint(run):
    for s in range(0, 11):
        with atomic_dir(run.rollout_step(s)) as tmp:
            (tmp / "meta.json").write_text("{}")
        run.samples.mkdir(exist_ok=True)
        run.samples_step(s).write_text("{}\n")
    write_step(run, 10, weights=False)  # a newer checkpoint (say, the one resume skipped)
    rows = [json.dumps({"step": s, "x": s}) + "\n" for s in range(11)]
    run.metrics_file("trainer").write_text("".join(rows) + '{"step": 11, "x"')  # killed mid-line
    (run.checkpoint(8) / ".trainer.tmp").mkdir()
    (run.root / ".model.tmp-123").mkdir()
    removed = reconcile(run, 8)
    assert "checkpoints/step_10" in removed and "weights/step_9" not in removed
    assert [int(p.name[5:]) for p in sorted(run.rollouts.iterdir())] == list(range(8))
    assert sorted(int(p.stem[5:]) for p in run.samples.iterdir()) == list(range(8))
    assert run.metrics_file("trainer").read_text() == "".join(rows[:8])
    assert not (run.checkpoint(8) / ".trainer.tmp").exists() and not (run.root / ".model.tmp-123").exists()
    assert verify_sealed(run.checkpoint(8, "trainer")) is None
    assert reconcile(run, 8) == []  # once is enough: a second pass finds nothing


def test_keep_last_keeps_what_a_resume_needs(run):
    write_step(run, 12)
    # being written: not complete, newer than the kept ones
    (run.checkpoint(16, "trainer")).mkdir(parents=True)
    assert prune_checkpoints(run, 2) == [4]
    assert sorted(int(p.name[5:]) for p in run.checkpoints.iterdir()) == [8, 12, 16]
    assert prune_checkpoints(run, 5) == []  # fewer complete checkpoints than keep_last: nothing goes


def test_progress_survives_files_rewritten_under_it(tmp_path, caplog):
    run = RunDir(tmp_path / "run").create()
    path = run.metrics_file("trainer")
    path.write_text(
        "".join(json.dumps({"step": s, "time": float(s), "train/loss": 1.0}) + "\n" for s in range(10))
    )
    progress = Progress(run, enabled=False, max_steps=10)
    progress.update()
    assert progress.last["trainer"]["step"] == 9
    # a resumed trainer rewrites its file shorter, then appends: the old offset now points mid-line
    path.write_text("".join(json.dumps({"step": s, "time": float(s)}) + "\n" for s in range(5)))
    with path.open("a") as f:
        f.write(json.dumps({"step": 5, "time": 50.0}) + "\n" + "not json\n" + "[1, 2]\n")
    progress.update()
    assert progress.last["trainer"]["step"] == 5 and not progress.failed
    path.write_text("\x00\xff garbage")
    progress.update()
    assert progress.last["trainer"]["step"] == 5 and not progress.failed
    progress.run = None  # any other error: logged once, the run goes on
    with caplog.at_level(logging.WARNING):
        progress.update()
        progress.update()
    assert progress.failed and caplog.text.count("progress display stopped") == 1


def test_the_reconcile_command_readies_a_run_dir_for_processes_started_on_their_own(run):
    from helpers.launch import asyncrl

    with atomic_dir(run.rollout_step(9)) as tmp:  # written after checkpoint 8 by the crashed run
        (tmp / "meta.json").write_text("{}")
    fresh = asyncrl("reconcile", f"run_dir={run.root}", "max_steps=12", "async_level=1")
    assert (
        fresh.returncode == 2
        and "already holds a run" in fresh.stderr
        and "ckpt.resume=latest" in fresh.stderr
    )
    resumed = asyncrl(
        "reconcile", f"run_dir={run.root}", "max_steps=12", "async_level=1", "ckpt.resume=latest"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from checkpoint step 8" in resumed.stderr and "rollouts/step_9" in resumed.stderr
    assert not run.rollout_step(9).exists()
