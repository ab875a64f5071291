"""docs/multi-turn.md's built-in multi-turn environment, verbatim, against a real sidecar: each turn a branch
of exactly the sampled tokens, the whole conversation in ``info``, and a seeded group replayed token for
token."""

from __future__ import annotations

import asyncio
import importlib
import re
import sys
from pathlib import Path

import pytest

from helpers.launch import MICRO_MODEL, serve_sidecar

ROOT = Path(__file__).resolve().parents[2]


def page_module(tmp_path: Path):
    """The page's ``guessnumber/env.py`` block written as a package and imported."""
    page = (ROOT / "docs" / "multi-turn.md").read_text()
    match = re.search(r"```python\n# guessnumber/env.py\n(.*?)```", page, re.S)
    assert match, "docs/multi-turn.md has no ```python block starting with # guessnumber/env.py"
    (tmp_path / "guessnumber").mkdir()
    (tmp_path / "guessnumber" / "__init__.py").write_text("")
    (tmp_path / "guessnumber" / "env.py").write_text(match.group(1))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("guessnumber.env")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.fixture(scope="module")
def printable_sidecar(tmp_path_factory):
    """A random-init micro model whose characters cover the page's prompts, with room for a few turns."""
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model

    cfg = compose_config(
        [*MICRO_MODEL, "model.init.charset=ascii_printable", "model.init.max_position_embeddings=512"]
    )
    model = build_tiny_model(cfg.model.init, tmp_path_factory.mktemp("printable") / "model", seed=0)
    with serve_sidecar(model, tmp_path_factory) as server:
        yield server


def run_groups(module, sidecar, tmp_path, seed):
    from asyncrl.rollouts.client import InferencePool
    from asyncrl.rollouts.context import RolloutContext, Sampling
    from asyncrl.workers.scoring import Scorer
    from asyncrl.workers.threads import Threads

    env = module.GuessNumber("guess", tmp_path, {"high": 5, "max_turns": 3})
    rows = env.generate("train", 0)[:2]

    async def main():
        pool = InferencePool([sidecar["url"]], sidecar["model"], 120, 16)
        scorer = Scorer(Threads(2), 30.0)
        ctx = RolloutContext(pool, scorer, Sampling(1.0, 1.0, 8), sidecar["model"], sidecar["model"])
        try:
            return [await env.rollouts(ctx, row, 3, seed) for row in rows]
        finally:
            await scorer.close()
            await pool.close()

    return asyncio.run(main())


def test_the_pages_environment_trains_each_turn_and_keeps_the_conversation(printable_sidecar, tmp_path):
    module = page_module(tmp_path)
    groups = run_groups(module, printable_sidecar, tmp_path, seed=11)
    assert [len(g) for g in groups] == [3, 3]
    for r in (r for g in groups for r in g):
        turns = r.info["turns"]
        assert 1 <= turns == len(r.branches) <= 3 and r.info["stop"] in ("solved", "max_turns")
        assert (r.info["stop"] == "solved") == (r.reward > 0) and 0.0 <= r.reward <= 1.0
        roles = [m["role"] for m in r.info["transcript"]]
        # the environment's answer between replies
        assert roles[: 2 * turns] == ["user", "assistant"] * turns
        assert [m["content"] for m in r.info["transcript"] if m["role"] == "assistant"][-1] == r.text
        for earlier, later in zip(r.branches, r.branches[1:], strict=False):
            assert len(later.prompt_ids) > len(earlier.prompt_ids)  # the conversation so far, as sent
        for b in r.branches:
            assert len(b.completion_ids) == len(b.completion_logprobs) == len(b.completion_mask) > 0
            assert all(b.completion_mask) and all(lp <= 0.0 for lp in b.completion_logprobs)
    again = run_groups(module, printable_sidecar, tmp_path, seed=11)
    tokens = [[b.completion_ids for b in r.branches] for g in groups for r in g]
    assert tokens == [[b.completion_ids for b in r.branches] for g in again for r in g]  # seeds per request


def page_package(tmp_path: Path) -> Path:
    """The page's ``asyncrl_guess/__init__.py`` block written as a package; the folder to put on
    ``sys.path``."""
    page = (ROOT / "docs" / "multi-turn.md").read_text()
    match = re.search(r"```python\n# asyncrl_guess/__init__.py\n(.*?)```", page, re.S)
    assert match, "docs/multi-turn.md has no ```python block starting with # asyncrl_guess/__init__.py"
    (tmp_path / "pkg" / "asyncrl_guess").mkdir(parents=True)
    (tmp_path / "pkg" / "asyncrl_guess" / "__init__.py").write_text(match.group(1))
    return tmp_path / "pkg"


def test_the_pages_verifiers_taskset_runs_its_game(printable_sidecar, tmp_path, monkeypatch):
    """The verifiers block, by its taskset id: every episode is the game (the environment's answers between
    the replies, at most max_turns replies), scored by the page's reward and metric; a taskset argument typo
    is refused with the taskset's fields."""
    from asyncrl.config import ConfigError
    from asyncrl.envs.vf_env import VerifiersEnv
    from helpers.vf_support import run_env

    monkeypatch.syspath_prepend(str(page_package(tmp_path)))
    args = {
        "taskset": "asyncrl-guess",
        "taskset_args": {"num_tasks": 8, "high": 3},
        "num_eval": 2,
        "max_turns": 3,
    }
    per_task, counts = run_env(printable_sidecar, tmp_path, args, n=3, max_tokens=8)
    rollouts = [r for rows in per_task for r in rows]
    assert len(rollouts) == 6 and counts["rollout/reward_errors"] == 0
    for r in rollouts:
        replies = [m for m in r.info["transcript"] if m["role"] == "assistant"]
        answers = [m["content"] for m in r.info["transcript"][1:] if m["role"] == "user"]
        assert 1 <= len(replies) <= 3 and r.info["metrics"]["turns_used"] == len(replies)
        assert len(answers) == len(replies) - 1  # the game's answer between two replies, none after the last
        assert set(answers) <= {"higher", "lower", "Reply `guess: N`."}, answers
        assert r.reward == 1.0 or (r.reward == 0.0 and len(replies) == 3)  # solved, or out of guesses
    with pytest.raises(ConfigError, match="hihg") as e:
        VerifiersEnv("vf_guess", tmp_path, {**args, "taskset_args": {"hihg": 5}})
    assert "high" in str(e.value).replace("hihg", "")
