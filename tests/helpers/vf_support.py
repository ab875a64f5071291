"""Helpers of the verifiers-environment tests (CPU and GPU): run episodes in-process against a sidecar,
record what the sidecar's token route answered, and check that the trained tokens are exactly those."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx

from helpers import zygote


def record_generate_calls(monkeypatch) -> list[tuple[dict, dict]]:
    """Every ``/inference/v1/generate`` call verifiers' TrainClient makes from now on, as ``(request body,
    response body)``, appended as they complete."""
    import verifiers.v1.clients.train as train

    calls: list[tuple[dict, dict]] = []
    original = train.build_async_openai

    def recording(config):
        client = original(config)

        async def hook(response: httpx.Response) -> None:
            if response.url.path.endswith("/inference/v1/generate"):
                await response.aread()
                calls.append((json.loads(response.request.content), response.json()))

        client._client.event_hooks["response"].append(hook)
        return client

    monkeypatch.setattr(train, "build_async_openai", recording)
    return calls


def run_env(
    sidecar: dict,
    tmp_path,
    args: dict,
    n: int,
    seed: int = 7,
    max_tokens: int = 8,
    timeout_s: float = 30.0,
    temperature: float = 1.0,
    tasks: int = 2,
    workers: int = 0,
    lag: list[float] | None = None,
    env_type: str = "verifiers",
):
    """``n`` episodes of each of the first ``tasks`` train tasks of a verifiers environment (``args``: its
    ``env.<name>.args``) against ``sidecar``:
    ``([rollouts of task 0, rollouts of task 1, ...], scorer counts)``. The episodes run in this process, or
    in ``workers`` env worker processes; ``lag`` gets this process's worst event-loop lateness meanwhile (a 5
    ms timer). ``env_type``: another environment that runs whole episodes."""
    from asyncrl.config.orchestrator import EnvSpec
    from asyncrl.envs.registry import env_class
    from asyncrl.rollouts.answers import TOKEN_VERSIONS
    from asyncrl.rollouts.client import InferencePool
    from asyncrl.rollouts.context import RolloutContext, Sampling
    from asyncrl.workers.pool import EnvWorkers
    from asyncrl.workers.scoring import Scorer
    from asyncrl.workers.threads import Threads

    env = env_class(env_type)("vf", tmp_path, args)
    rows = env.generate("train", 0)

    async def main():
        versions: Counter = Counter()  # what the orchestrator's group task counts for staleness
        TOKEN_VERSIONS.set(versions)
        pool = InferencePool([sidecar["url"]], sidecar["model"], 120, 16)
        specs = {"vf": EnvSpec(type=env_type, args=args)}
        runner = EnvWorkers(specs, tmp_path, workers, workers, 4) if workers else Threads(4)
        scorer = Scorer(runner, timeout_s)
        ctx = RolloutContext(
            pool, scorer, Sampling(temperature, 1.0, max_tokens), sidecar["model"], sidecar["model"]
        )
        meter = asyncio.create_task(_lag_meter(lag if lag is not None else []))
        try:
            out = [await env.rollouts(ctx, row, n, seed) for row in rows[:tasks]]
        finally:
            meter.cancel()
            await env.close()
            await scorer.close()
            await pool.close()
        return out, {**scorer.take_counts(), "token_versions": dict(versions)}

    with zygote.fork_servers():  # the env workers' server: a fork of the zygote, as in a forked command
        return asyncio.run(main())


async def _lag_meter(lag: list[float]) -> None:
    lag.append(0.0)
    while True:
        start = time.monotonic()
        await asyncio.sleep(0.005)
        lag[0] = max(lag[0], time.monotonic() - start - 0.005)


def sampled_spans(branch) -> list[tuple[int, list[int], list[float]]]:
    """``(start, ids, logprobs)`` of each run of trained tokens in a branch's token stream."""
    stream = branch.prompt_ids + branch.completion_ids
    mask = [False] * len(branch.prompt_ids) + branch.completion_mask
    lps = [0.0] * len(branch.prompt_ids) + branch.completion_logprobs
    spans, i = [], 0
    while i < len(stream):
        if mask[i]:
            j = i
            while j < len(stream) and mask[j]:
                j += 1
            spans.append((i, stream[i:j], lps[i:j]))
            i = j
        else:
            i += 1
    return spans


def check_trained_tokens(rollouts: list, recorded: list[tuple[dict, dict]]) -> None:
    """Every trained span of every branch is one token-route answer (its ids, its logprobs) that followed
    exactly the stream before it as the prompt; every answer is trained exactly once. (Two episodes may
    sample the same reply to the same prompt: identical answers are interchangeable, each is matched
    once.)"""
    used: list[int] = []
    for r in rollouts:
        for b in r.branches:
            stream = b.prompt_ids + b.completion_ids
            for start, ids, lps in sampled_spans(b):
                match = [
                    k
                    for k, (req, resp) in enumerate(recorded)
                    if k not in used
                    and req["token_ids"] == stream[:start]
                    and resp["choices"][0]["token_ids"] == ids
                ]
                assert match, ("no token-route answer was this span", start, ids)
                resp = recorded[match[0]][1]["choices"][0]
                assert lps == [e["logprob"] for e in resp["logprobs"]["content"]]
                used.append(match[0])
    assert sorted(used) == list(range(len(recorded)))
