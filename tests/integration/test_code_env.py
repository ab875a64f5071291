"""The code environment: replies' code run in the sandbox against hidden tests (reward = fraction passed),
generated problems whose reference solutions pass, code datasets' tests read without running them, and a
refusal (not a score of 0) where isolation is unavailable."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.envs.code_problems import FAMILY_NAMES
from asyncrl.envs.registry import env_class
from asyncrl.rewards.code import call_tests_from_asserts, extract_code
from asyncrl.rollouts.answers import ChatOut, ChoiceOut
from asyncrl.rollouts.context import RolloutContext, Sampling
from asyncrl.sandbox import SandboxUnavailable
from asyncrl.workers.scoring import Scorer
from asyncrl.workers.threads import Threads
from helpers.fakes import offline_hub, unusable_bwrap


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = env_class("code")(
        "code", tmp_path_factory.mktemp("code"), {"num_train": 300, "num_eval": 40, "workers": 2}
    )
    yield env
    asyncio.run(env.close())


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        ("```python\ndef f(): return 1\n```", "def f(): return 1\n"),
        ("```\nA\n```\ntext\n```py\nB\n```\n```\nC\n```", "B\n"),  # the last python block wins
        ("```\nA\n```\n```text\nC\n```", "C\n"),  # no python label: the last block
        ("def f(x):\n    return x", "def f(x):\n    return x"),  # no fence: the whole reply
        ("```python\ndef f(x):\n    return", "def f(x):\n    return"),  # cut off by the token limit
        ("no code, just ``` a stray fence", ""),
        ("", ""),
    ],
)
def test_extract_code(reply, code):
    assert extract_code(reply) == code


def test_every_generated_family_is_solved_by_its_reference_and_not_by_a_wrong_program(env):
    rows = env.generate("train", 0)
    by_family = {}
    for row in rows:
        by_family.setdefault(row["family"], row)
    assert sorted(by_family) == sorted(FAMILY_NAMES)  # every family drawn in 300 problems
    for family, row in by_family.items():
        assert len(row["tests"]) == 5 and "For example" in row["question"], family
        assert env.reward(row, env.answer(row)) == 1.0, family
        wrong = (
            "print(0)"
            if row["tests"][0]["kind"] == "io"
            else f"def {row['tests'][0]['fn']}(*a):\n    return 0"
        )
        assert env.reward(row, fenced(wrong)) < 1.0, family


def test_reward_is_the_fraction_of_hidden_tests_passed(env):
    row = {
        "question": "double",
        "tests": [
            {"kind": "call", "fn": "double", "args": [x], "kwargs": {}, "expected": 2 * x}
            for x in (0, 1, 2, 3)
        ],
    }
    assert env.reward(row, fenced("def double(x):\n    return 2 * x")) == 1.0
    assert env.reward(row, fenced("def double(x):\n    return x + x if x < 2 else 0")) == 0.5  # 0, 1 right
    assert env.reward(row, fenced("def double(x):\n    return 1 / x * 2 * x * x")) == 0.75  # x=0 raises
    assert env.reward(row, "I cannot write code.") == 0.0
    assert env.reward(row, fenced("def double(x):\n    while True: pass")) == 0.0


def test_data_is_seeded_and_eval_problems_are_held_out(tmp_path):
    a = env_class("code")("code", tmp_path, {"num_train": 200, "num_eval": 30})
    b = env_class("code")("code", tmp_path / "b", {"num_train": 200, "num_eval": 30})
    assert a.generate("train", 1) == b.generate("train", 1) != a.generate("train", 2)
    held = {r["question"] for r in a.generate("eval", 1)}
    assert len(held) == 30 and not held & {r["question"] for r in a.generate("train", 1)}
    only = env_class("code")(
        "code", tmp_path, {"num_train": 20, "num_eval": 5, "families": ["caesar", "stdin_sum"]}
    )
    assert {r["family"] for r in only.generate("train", 0)} == {"caesar", "stdin_sum"}


def test_asserts_become_call_tests_and_the_rest_is_skipped():
    source = """
assert add(1, 2) == 3
assert (4, 5) == pair(x=4, y=5)
assert math.isclose(area(2), 12.56, rel_tol=0.01)
assert add(y, 1) == 2
assert sorted(add(1, 2)) == [3]
assert add(1, 2)
"""
    tests, skipped = call_tests_from_asserts(source)
    assert tests == [
        {"kind": "call", "fn": "add", "args": [1, 2], "kwargs": {}, "expected": 3},
        {"kind": "call", "fn": "pair", "args": [], "kwargs": {"x": 4, "y": 5}, "expected": (4, 5)},
    ]
    assert skipped == 4
    humaneval = "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert helper(1) == 1\n"
    assert call_tests_from_asserts(humaneval, "total")[0] == [
        {"kind": "call", "fn": "total", "args": [[1, 2]], "kwargs": {}, "expected": 3}
    ]
    assert call_tests_from_asserts("assert f(1) == (", "")[1] == 1  # a syntax error: skipped, not raised


MBPP = [
    {
        "task_id": k,
        "text": f"Write a function to add {k} to a number.",
        "code": f"def add_{k}(x):\n    return x + {k}",
        "test_list": [f"assert add_{k}({x}) == {x + k}" for x in (1, 2, 3)],
        "test_setup_code": "",
        "challenge_test_list": [],
    }
    for k in range(12)
] + [
    {
        "task_id": 99,
        "text": "untestable",
        "code": "",
        "test_list": ["assert g() is None"],
        "test_setup_code": "",
    }
]
HUMANEVAL = [
    {
        "task_id": f"HumanEval/{k}",
        "prompt": f'def times_{k}(x):\n    """x times {k}"""\n',
        "canonical_solution": f"    return x * {k}\n",
        "test": f"def check(candidate):\n    assert candidate(2) == {2 * k}\n"
        f"    assert candidate(-1) == {-k}\n",
        "entry_point": f"times_{k}",
    }
    for k in range(8)
]
APPS = [
    {
        "question": f"Print the sum of the input numbers plus {k}.",
        "solutions": json.dumps([f"print(sum(map(int, input().split())) + {k})"]),
        "input_output": json.dumps({"inputs": ["1 2\n", "5\n"], "outputs": [f"{3 + k}\n", f"{5 + k}\n"]}),
    }
    for k in range(8)
] + [
    {
        "question": "call based",
        "solutions": "[]",
        "input_output": json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [[1]]}),
    }
]


@pytest.mark.parametrize(
    ("layout", "records", "usable"), [("mbpp", MBPP, 12), ("humaneval", HUMANEVAL, 8), ("apps", APPS, 8)]
)
def test_code_datasets_from_a_local_file_score_their_reference_one(tmp_path, layout, records, usable):
    path = tmp_path / f"{layout}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    env = env_class("code")("code", tmp_path, {"source": f"file:{path}", "num_eval": 3, "workers": 1})
    try:
        held, train = env.generate("eval", 0), env.generate("train", 0)
        # the row without a usable test is dropped
        assert len(held) == 3 and len(held) + len(train) == usable
        for row in held:
            assert env.reward(row, env.answer(row)) == 1.0
            assert env.reward(row, fenced("def nothing(): pass")) == 0.0
        if layout == "mbpp":
            assert "Your code should pass these tests:\nassert add_" in held[0]["question"]
    finally:
        asyncio.run(env.close())


def test_code_dataset_from_the_hub_goes_through_datasets_with_its_preset(tmp_path, monkeypatch):
    calls = offline_hub(
        monkeypatch, {"google-research-datasets/mbpp": MBPP, "openai/openai_humaneval": HUMANEVAL}
    )
    env = env_class("code")(
        "code",
        tmp_path,
        {"source": "hub:openai/openai_humaneval", "source_args": {"split": "test"}, "num_eval": 2},
    )
    row = env.generate("eval", 0)[0]
    assert calls[-1] == ("openai/openai_humaneval", {"split": "test"}) and row["tests"][0]["fn"].startswith(
        "times_"
    )
    env = env_class("code")("code", tmp_path, {"source": "hub:google-research-datasets/mbpp", "num_eval": 2})
    assert env.generate("eval", 0)[0]["tests"][0]["fn"].startswith("add_")


def test_a_record_in_no_known_layout_is_refused_with_its_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")
    env = env_class("code")("code", tmp_path, {"source": f"file:{path}", "num_eval": 1})
    with pytest.raises(ValueError, match=r"no known layout \(fields \['answer', 'prompt'\]\)"):
        env.generate("eval", 0)


def test_config_errors_name_the_key(tmp_path):
    for args, message in [
        ({"families": ["scale", "nope"]}, "env.c.args.families: unknown \\['nope'\\]"),
        ({"sandbox": {"memory": 1}}, "env.c.args.sandbox has unknown key\\(s\\) \\['memory'\\]"),
        ({"sandbox": {"timeout_s": -1}}, "env.c.args.sandbox.timeout_s"),
        ({"source": "ftp:x"}, "env.c.args.source='ftp:x'"),
        ({"format": "csv"}, "env.c.args.format"),
    ]:
        with pytest.raises(ConfigError, match=message):
            env_class("code")("c", tmp_path, args)


class ScriptedPool:
    """Stands in for the sidecars: returns the given replies and records that it was asked."""

    def __init__(self, replies: list[str]):
        self.replies, self.calls = replies, 0

    async def chat(self, messages, n, temperature, top_p, max_tokens, seed, **truncation):
        self.calls += 1
        choices = [ChoiceOut([1, 2], [-0.1, -0.2], t, "stop") for t in self.replies]
        return ChatOut([0], choices[:n])


def test_episodes_score_solutions_and_attacks_through_the_orchestrators_guard(env):
    row = env.generate("eval", 0)[0]
    attacks = [
        "import os\nwhile True:\n    os.fork()",  # fork bomb
        "x = bytearray(1 << 34)",  # memory bomb
        "while True:\n    pass",
        "import ctypes\nctypes.string_at(0)",  # segfault
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        # attach to the runner: the seccomp filter kills it
        "import ctypes\nctypes.CDLL(None).ptrace(16, 1, 0, 0)",
    ]
    replies = [env.answer(row)] + [fenced(a) for a in attacks]
    pool = ScriptedPool(replies)

    async def episodes():
        scorer = Scorer(Threads(4), timeout_s=30)
        ctx = RolloutContext(pool, scorer, Sampling(1.0, 1.0, 64), "m", "m")
        return await env.rollouts(ctx, row, len(replies), 0), scorer.take_counts()

    rollouts, counts = asyncio.run(episodes())
    assert [r.reward for r in rollouts] == [1.0] + [0.0] * len(attacks)
    none = {"denied_syscall": 0.0, "sandbox_timeout": 0.0, "sandbox_over_limit": 0.0, "sandbox_crashed": 0.0}
    assert rollouts[0].info["metrics"] == {"code_block": 1.0, "all_passed": 1.0, **none}
    assert [r.info["metrics"]["denied_syscall"] for r in rollouts] == [0.0] * len(attacks) + [1.0]
    # the loop runs past the program's deadline; nothing crashes a sandbox (its runner is out of the
    # programs' reach)
    assert [r.info["metrics"]["sandbox_timeout"] for r in rollouts] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert sum(r.info["metrics"]["sandbox_crashed"] for r in rollouts) == 0
    assert counts == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}


def test_no_isolation_refuses_the_episode_before_any_request(tmp_path):
    pool = ScriptedPool(["```python\nprint(1)\n```"])
    ctx = RolloutContext(pool, Scorer(Threads(1), timeout_s=5), Sampling(1.0, 1.0, 8), "m", "m")
    with unusable_bwrap() as fake:
        env = env_class("code")(
            "code", tmp_path, {"num_train": 5, "num_eval": 2, "workers": 1, "bwrap": fake}
        )
        with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
            asyncio.run(env.rollouts(ctx, env.generate("eval", 0)[0], 1, 0))
    assert pool.calls == 0


def test_a_sandbox_that_becomes_unavailable_mid_run_stops_the_episode(tmp_path, monkeypatch):
    """Isolation that worked at start and fails later (here: bwrap can no longer create namespaces) is
    retried, then raised with its cause, which fails the orchestrator, instead of scoring every later sample
    0."""
    from asyncrl.workers import scoring

    monkeypatch.setattr(scoring, "RETRY_WAIT_S", 0.01)
    env = env_class("code")("code", tmp_path, {"num_train": 5, "num_eval": 2, "workers": 1})
    row = env.generate("eval", 0)[0]
    ctx = RolloutContext(
        ScriptedPool([env.answer(row)]), Scorer(Threads(1), timeout_s=30), Sampling(1.0, 1.0, 64), "m", "m"
    )
    try:
        assert [r.reward for r in asyncio.run(env.rollouts(ctx, row, 1, 0))] == [1.0]
        with unusable_bwrap() as fake:
            # every sandbox started from now on fails; the one already warm still runs
            env._pool.bwrap = fake
            assert [r.reward for r in asyncio.run(env.rollouts(ctx, row, 1, 0))] == [1.0]
            with pytest.raises(scoring.ScoringUnavailable, match="could not be scored 3 times") as e:
                asyncio.run(env.rollouts(ctx, row, 1, 0))
        assert "No permissions to create new namespace" in str(e.value)
        assert ctx.scorer.take_counts() == {"rollout/reward_errors": 0, "rollout/reward_timeouts": 0}
    finally:
        asyncio.run(env.close())
