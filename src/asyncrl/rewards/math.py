"""Math answers checked symbolically: math-verify on the final answer (the last ``\\boxed{}``, else the last
expression), robust to any model output (anything it cannot parse scores 0)."""

from __future__ import annotations

from asyncrl.rewards import workers


def strip_gold(answer: str) -> str:
    """A reference answer as math-verify's gold: GSM8K's ``... #### 72`` keeps ``72``; thousands commas go."""
    answer = answer.split("####")[-1].strip()
    return answer.replace(",", "") if answer.replace(",", "").lstrip("-").replace(".", "", 1).isdigit() else answer


def verify_answer(gold: str, completion: str) -> float:
    """1.0 if the completion's final answer equals ``gold`` (symbolically, or numerically to 6 places)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # the timeouts use signal.alarm (main thread only): off; workers.call bounds the time instead
    target = parse(f"${strip_gold(gold)}$", extraction_config=extraction, parsing_timeout=None)
    if not target:
        raise ValueError(f"the reference answer {gold!r} does not parse")
    predicted = parse(completion, extraction_config=extraction, parsing_timeout=None)
    return float(bool(predicted) and verify(target, predicted, timeout_seconds=None))


def math_reward(gold: str, completion: str, timeout_s: float = 5.0) -> float:
    """:func:`verify_answer` in a worker process, killed past ``timeout_s`` (then it raises ``TimeoutError``,
    which the orchestrator's scorer counts as a timeout and scores 0)."""
    return workers.call(verify_answer, gold, completion, timeout_s=timeout_s)
