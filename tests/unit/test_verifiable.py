"""Verifiable rewards: math-verify in worker processes (any output scores 0 or 1; a hang is killed, scores 0,
counted), reasoning-gym's tasks (seeded data, its scorers, per-task metrics), the math loaders."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.envs.registry import env_class
from asyncrl.rewards.math import math_reward, strip_gold
from asyncrl.rewards.reasoning_gym import extract_answer
from asyncrl.workers.scoring import Scorer
from asyncrl.workers.threads import Threads
from helpers.fakes import offline_hub


def build(type_name: str, tmp_path, **args):
    return env_class(type_name)("t", tmp_path, args)


@pytest.mark.parametrize(
    ("gold", "completion", "expected"),
    [
        ("72", "so the total is \\boxed{72}", 1.0),
        ("72", "first 70, then \\boxed{71}", 0.0),
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
        ("\\frac{1}{2}", "x = 3 and then the answer is 1/2", 1.0),
        ("1,000", "\\boxed{1000}", 1.0),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "\\boxed{72}", 1.0),
        ("72", "", 0.0),
        ("72", "\\boxed{", 0.0),
        ("72", "))((\\frac{}{}\x00\ud800 71 \\boxed{\\boxed{}}", 0.0),  # garbage, surrogates, NUL: no raise
    ],
)
def test_math_reward_on_any_output(gold, completion, expected):
    assert math_reward(gold, completion) == expected


@pytest.mark.parametrize(
    ("question", "gold", "completion", "expected"),
    [
        # what RL learned on SmolLM2: restating scores 0
        ("Calculate 19 - 58.", "-39", "19 - 58 = 19 - 58.", 0.0),
        ("Calculate 19 - 58.", "-39", "\\boxed{19-58}", 0.0),
        ("Calculate 19 - 58.", "-39", "19 - 58 = -39", 1.0),
        ("Calculate 19 - 58.", "-39", "\\boxed{-39}", 1.0),
        ("Is 7 the answer? Calculate 3 + 4.", "7", "7", 1.0),  # a plain number is never a restatement
        # the gold itself
        ("What is $\\frac{1}{2}$ as a fraction?", "\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", 1.0),
        ("Simplify $\\frac{2}{4}$.", "\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", 0.0),
    ],
)
def test_an_expression_restated_from_the_question_is_no_answer(question, gold, completion, expected):
    assert math_reward(gold, completion, question=question) == expected


def test_a_math_check_that_hangs_is_killed_and_scores_zero_counted():
    async def main():
        scorer = Scorer(Threads(2), timeout_s=30)
        # sympy would evaluate this tower for ever: the worker is killed at 1 s, the scorer counts a timeout
        score = await scorer.score(
            lambda ex, c: math_reward("2", c, timeout_s=1.0), {}, "\\boxed{9^{9^{9^{9}}}}"
        )
        return score, scorer.take_counts(), math_reward("2", "\\boxed{2}")

    score, counts, after = asyncio.run(main())
    assert score == 0.0 and counts["rollout/reward_timeouts"] == 1 and after == 1.0  # the pool works on


def test_strip_gold_and_answer_tags():
    assert strip_gold("a\n#### 1,234") == "1234" and strip_gold("\\frac{1}{2}") == "\\frac{1}{2}"
    assert extract_answer("think <answer>1</answer> more <answer> 2 </answer>") == "2"
    assert extract_answer(" 42 ") == "42"


def test_reasoning_gym_data_is_seeded_disjoint_and_scored_by_its_task(tmp_path):
    env = build(
        "reasoning_gym",
        tmp_path,
        task="chain_sum",
        task_args={"min_terms": 2, "max_terms": 2},
        num_train=300,
        num_eval=50,
    )
    train, held = env.generate("train", 0), env.generate("eval", 0)
    assert train == env.generate("train", 0) and train != env.generate("train", 1)
    assert len(held) == 50 and 0 < len(train) <= 300
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    ex = json.loads(json.dumps(held[0]))  # as read back from the JSONL
    assert env.reward(ex, env.answer(ex)) == 1.0 and env.reward(ex, "wrong") == 0.0
    assert env.reward(ex, f"thinking... <answer>{ex['answer']}</answer>") == 1.0


def test_reasoning_gym_weighted_tasks_and_per_task_metrics(tmp_path):
    env = build(
        "reasoning_gym",
        tmp_path,
        tasks=[
            {"name": "chain_sum", "weight": 3.0, "config": {"max_terms": 2}},
            {"name": "spell_backward", "weight": 1.0},
        ],
        num_train=400,
        num_eval=40,
    )
    rows = env.generate("train", 0)
    counts = {t: sum(r["task"] == t for r in rows) for t in ("chain_sum", "spell_backward")}
    assert counts["chain_sum"] > 2 * counts["spell_backward"] > 0
    spell = next(r for r in rows if r["task"] == "spell_backward")
    assert env.reward(spell, spell["answer"]) == 1.0


def test_reasoning_gym_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="env.t.args.task: unknown reasoning-gym task 'nope'"):
        build("reasoning_gym", tmp_path, task="nope")
    with pytest.raises(ConfigError, match="give exactly one"):
        build("reasoning_gym", tmp_path, task="chain_sum", tasks=[{"name": "gcd"}])
    with pytest.raises(ConfigError, match="tasks\\[0\\]"):
        build("reasoning_gym", tmp_path, tasks=[{"task": "gcd"}])


GSM8K_ROWS = [
    {
        "question": f"Tom has {k} apples and buys {k + 1} more. How many?",
        "answer": f"{k}+{k + 1}={2 * k + 1}\n#### {2 * k + 1:,}",
    }
    for k in range(1, 600, 20)
]
MATH500_ROWS = [
    {"problem": f"What is $\\frac{{{k}}}{{{2 * k}}}$?", "answer": "\\frac{1}{2}", "level": 1}
    for k in range(1, 31)
]


def test_math_from_a_local_file_in_gsm8k_and_math500_layouts(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    env = build("math", tmp_path, source=f"file:{gsm}", num_eval=5)
    held, train = env.generate("eval", 0), env.generate("train", 0)
    assert len(held) == 5 and len(train) == len(GSM8K_ROWS) - 5
    row = held[0]
    assert "####" not in row["answer"] and env.reward(row, env.answer(row)) == 1.0

    m500 = tmp_path / "math500.json"
    m500.write_text(json.dumps(MATH500_ROWS))
    env = build("math", tmp_path, source=f"file:{m500}", question_key="problem", num_eval=5)
    row = env.generate("eval", 0)[0]
    assert row["question"].startswith("What is") and env.reward(row, "it is \\boxed{0.5}") == 1.0
    with pytest.raises(ValueError, match="has no 'question'"):
        build("math", tmp_path, source=f"file:{m500}", num_eval=5).generate("eval", 0)


def test_math_from_the_hub_goes_through_datasets_with_its_preset(tmp_path, monkeypatch):
    calls = offline_hub(monkeypatch, {"openai/gsm8k": GSM8K_ROWS, "HuggingFaceH4/MATH-500": MATH500_ROWS})
    env = build(
        "math",
        tmp_path,
        source="hub:openai/gsm8k",
        source_args={"name": "main", "split": "train"},
        num_eval=3,
    )
    assert len(env.generate("eval", 0)) == 3 and calls[-1] == (
        "openai/gsm8k",
        {"name": "main", "split": "train"},
    )
    env = build(
        "math", tmp_path, source="hub:HuggingFaceH4/MATH-500", source_args={"split": "test"}, num_eval=3
    )
    assert env.generate("eval", 0)[0]["answer"] == "\\frac{1}{2}"  # the preset's field names


def test_math_generated_by_reasoning_gym(tmp_path):
    env = build(
        "math",
        tmp_path,
        source="reasoning_gym:basic_arithmetic",
        num_train=50,
        num_eval=10,
        system_prompt=None,
    )
    row = env.generate("eval", 0)[0]
    assert env.prompt(row) == [{"role": "user", "content": row["question"]}]
    assert env.reward(row, env.answer(row)) == 1.0 and env.reward(row, "\\boxed{nope}") == 0.0
    with pytest.raises(ConfigError, match="source='ftp:x'"):
        build("math", tmp_path, source="ftp:x")
