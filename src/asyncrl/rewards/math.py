"""Math answers checked symbolically: math-verify on the final answer (the last ``\\boxed{}``, else the last
expression), robust to any model output (anything it cannot parse scores 0)."""

from __future__ import annotations

import re

from asyncrl.rewards import killable

_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def strip_gold(answer: str) -> str:
    """A reference answer as math-verify's gold: GSM8K's ``... #### 72`` keeps ``72``; thousands commas
    go."""
    answer = answer.split("####")[-1].strip()
    return (
        answer.replace(",", "")
        if answer.replace(",", "").lstrip("-").replace(".", "", 1).isdigit()
        else answer
    )


def _normal(text: str) -> str:
    return re.sub(r"[\s$]", "", text).rstrip(".")


def restates(answer: str, question: str, gold: str = "") -> bool:
    """Whether ``answer`` (the extracted final answer's text) is an expression copied from the question:
    ``Calculate 19 - 58.`` answered ``19 - 58`` is symbolically equal to the gold (-39) but no answer, and RL
    learns to reply that (a small model such as SmolLM2 drifts to it within tens of RL steps). Plain numbers
    and the gold's own text are never restatements."""
    a = _normal(answer)
    return bool(a) and not _NUMBER.fullmatch(a) and a != _normal(gold) and a in _normal(question)


def verify_answer(gold: str, completion: str, question: str = "") -> float:
    """1.0 if the completion's final answer equals ``gold`` (symbolically, or numerically to 6 places) and is
    not an expression restated from ``question`` (:func:`restates`)."""
    # lazy: seconds to import, and only the scoring workers need it (killable._warm imports it as they start)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # the timeouts use signal.alarm (main thread only): off; killable.call bounds the time instead
    target = parse(f"${strip_gold(gold)}$", extraction_config=extraction, parsing_timeout=None)
    if not target:
        raise ValueError(f"the reference answer {gold!r} does not parse")
    predicted = parse(completion, extraction_config=extraction, parsing_timeout=None)
    if not predicted or (question and restates(str(predicted[-1]), question, strip_gold(gold))):
        return 0.0
    return float(verify(target, predicted, timeout_seconds=None))


def math_reward(gold: str, completion: str, timeout_s: float = 5.0, question: str = "") -> float:
    """:func:`verify_answer` in a worker process, killed past ``timeout_s`` (then it raises ``TimeoutError``,
    which the orchestrator's scorer counts as a timeout and scores 0)."""
    return killable.call(verify_answer, gold, completion, question, timeout_s=timeout_s)
