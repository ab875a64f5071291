import json
import random

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.orchestrator import EnvSpec
from asyncrl.envs import Environment, PromptSampler, build_envs, env_class
from asyncrl.envs.reverse_text import ReverseText, lcs_length, lcs_ratio
from asyncrl.paths import data_file


def _lcs_dp(a, b):
    m = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a)):
        for j in range(len(b)):
            m[i + 1][j + 1] = m[i][j] + 1 if a[i] == b[j] else max(m[i][j + 1], m[i + 1][j])
    return m[-1][-1]


def test_lcs_matches_dynamic_programming():
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 25)))
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 25)))
        assert lcs_length(a, b) == _lcs_dp(a, b)


def test_reward_range_and_exact_match():
    env = ReverseText("rt", "/unused")
    ex = {"text": "hello world"}
    assert env.reward(ex, "dlrow olleh") == 1.0
    assert env.reward(ex, "") == 0.0
    assert 0 < env.reward(ex, "dlrow") < 1
    for junk in ["\x00\uffff", "x" * 10000, "🙂"]:  # model output is untrusted
        assert 0.0 <= env.reward(ex, junk) <= 1.0
    assert lcs_ratio("", "") == 1.0


def test_generate_is_seeded_and_splits_are_disjoint():
    env = ReverseText("rt", "/unused", {"num_train": 300, "num_eval": 50, "min_len": 4, "max_len": 9})
    train, evals = env.generate("train", 1), env.generate("eval", 1)
    assert train == env.generate("train", 1) and train != env.generate("train", 2)
    assert len(train) == 300 and len(evals) == 50
    assert not {r["text"] for r in train} & {r["text"] for r in evals}
    assert all(4 <= len(r["text"]) <= 9 for r in train + evals)


def test_unknown_and_invalid_args_name_the_key():
    with pytest.raises(
        ConfigError, match="env.rt.args has no key 'min_length'; did you mean env.rt.args.min_len"
    ):
        ReverseText("rt", "/unused", {"min_length": 3})
    with pytest.raises(ConfigError, match="env.rt.args.min_len=0 is out of range"):
        ReverseText("rt", "/unused", {"min_len": 0})
    with pytest.raises(ConfigError, match="unknown environment type"):
        env_class("nope")


class Upper(Environment):
    """A user environment defined outside the package, loaded by 'module:Class'."""

    def generate(self, split, seed):
        return [{"text": f"{split}{i}"} for i in range(3)]

    def prompt(self, example):
        return [{"role": "user", "content": example["text"]}]

    def reward(self, example, completion):
        return float(completion == example["text"].upper())


def _write(tmp_path, env):
    for split in env.splits:
        path = data_file(tmp_path, env.name, split)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in env.generate(split, 0)))


def test_user_environment_and_weighted_mixture(tmp_path):
    specs = {
        "up": EnvSpec(type=f"{__name__}:Upper", weight=3.0),
        "rt": EnvSpec(type="reverse_text", weight=1.0, args={"num_train": 50, "num_eval": 5}),
    }
    envs = build_envs(specs, tmp_path)
    assert isinstance(envs["up"], Upper)
    for env in envs.values():
        _write(tmp_path, env)
    sampler = PromptSampler(envs, {n: s.weight for n, s in specs.items()}, "train", seed=0)
    draws = [sampler.draw().env for _ in range(400)]
    assert 0.65 < draws.count("up") / 400 < 0.85  # weight 3:1


def test_sampler_resumes_the_same_sequence(tmp_path):
    envs = build_envs({"rt": EnvSpec(args={"num_train": 7, "num_eval": 2})}, tmp_path)
    _write(tmp_path, envs["rt"])
    a = PromptSampler(envs, {"rt": 1.0}, "train", seed=3)
    first = [a.draw().example["id"] for _ in range(10)]  # crosses an epoch boundary
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON, as in checkpoints
    rest = [a.draw().example["id"] for _ in range(10)]
    b = PromptSampler(envs, {"rt": 1.0}, "train", seed=3)
    b.load_state_dict(state)
    assert [b.draw().example["id"] for _ in range(10)] == rest
    assert sorted(first[:7]) == sorted(r["id"] for r in envs["rt"].load("train"))  # an epoch sees each once


def test_episode_metrics_average_what_each_rollout_reports():
    from asyncrl.rollouts.trajectory import Rollout, episode_metrics

    def rollout(metrics):
        return Rollout([], 0.0, "", "stop", {} if metrics is None else {"metrics": metrics})

    got = episode_metrics(
        [rollout({"correct": 1.0, "calls": 2.0}), rollout({"correct": 0.0}), rollout(None)]
    )
    assert got == {"calls_mean": 2.0, "correct_mean": 0.5}
    assert episode_metrics([rollout(None)]) == {}  # built-in environments report none: no keys at all


def _curriculum(tmp_path, num_train=6, skip_steps=3):
    envs = build_envs({"rt": EnvSpec(args={"num_train": num_train, "num_eval": 2})}, tmp_path)
    _write(tmp_path, envs["rt"])
    return PromptSampler(envs, {"rt": 1.0}, "train", seed=1, skip_steps=skip_steps, bounds=(0.1, 0.9))


def test_curriculum_skips_solved_and_hopeless_examples_for_skip_steps(tmp_path):
    s, plain = _curriculum(tmp_path), _curriculum(tmp_path, skip_steps=0)
    epoch = [s.draw() for _ in range(6)]  # step 0: one epoch, each example once
    assert [plain.draw().row for _ in range(6)] == [d.row for d in epoch]
    s.record(epoch[0], [1.0, 1.0])  # solved
    s.record(epoch[1], [0.0, 0.0])  # hopeless
    s.record(epoch[2], [0.0, 1.0])  # learnable: drawn again as usual
    s.record(epoch[3], [0.9, 0.9])  # on the bound: not past it
    skipped = {epoch[0].row, epoch[1].row}
    for now in (1, 2, 3):  # recorded at step 0 with skip_steps 3: not drawn at steps 1-3
        s.now = now
        rows = [s.draw().row for _ in range(8)]  # across epochs
        # the same walk as without a curriculum, with the skipped examples passed over, and each pass counted
        walk = []
        while len([r for r in walk if r not in skipped]) < 8:
            walk.append(plain.draw().row)
        assert rows == [r for r in walk if r not in skipped], (now, rows, walk)
        passed = len(walk) - len(rows)
        assert s.take_curriculum_counts() == {
            "rollout/curriculum_skipped": passed,
            "rollout/curriculum_skipping": 2,
        }
    s.now = 4
    assert {s.draw().row for _ in range(6)} == set(range(6))  # back in
    assert s.take_curriculum_counts() == {"rollout/curriculum_skipped": 0, "rollout/curriculum_skipping": 0}


def test_curriculum_history_is_checkpointed_and_draws_continue_the_same(tmp_path):
    a = _curriculum(tmp_path)
    for d in [a.draw() for _ in range(6)]:
        a.record(d, [1.0] if d.row % 2 else [0.5])  # odd rows solved
    a.now = 1
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON, as in checkpoints
    rest = [a.draw().row for _ in range(9)]
    assert all(r % 2 == 0 for r in rest)
    b = _curriculum(tmp_path)
    b.load_state_dict(state)
    b.now = 1
    assert [b.draw().row for _ in range(9)] == rest


def test_curriculum_with_every_example_skipped_still_draws(tmp_path, caplog):
    s = _curriculum(tmp_path, num_train=3)
    for d in [s.draw() for _ in range(3)]:
        s.record(d, [0.0])
    s.now = 1
    assert len([s.draw() for _ in range(5)]) == 5  # nothing else to draw: taken anyway, and said so
    assert "every example of env 'rt' is skipped" in caplog.text


def test_without_curriculum_records_change_nothing(tmp_path):
    a, b = _curriculum(tmp_path, skip_steps=0), _curriculum(tmp_path, skip_steps=0)
    for d in [a.draw() for _ in range(6)]:
        a.record(d, [0.0])
    a.now = 1
    [b.draw() for _ in range(6)]
    assert [a.draw().row for _ in range(6)] == [b.draw().row for _ in range(6)]
    assert a.take_curriculum_counts() == {} and "history" not in a.state_dict()
