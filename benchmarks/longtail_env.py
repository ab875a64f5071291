"""A reverse_text environment whose completions have a heavy-tailed length (benchmarks/rl_step.py --compare
schedule).

Lengths are set, not sampled from the model: each completion is its own request with its own ``max_tokens``,
and the run sends ``ignore_eos`` (``+orchestrator.extra_body.ignore_eos=true``), so it stops exactly there. A
fraction ``long_fraction`` of prompts (the "hard" ones: every completion of the group) run to 75-100% of
``orchestrator.max_tokens``; the others draw each completion's length uniformly from ``short_tokens / 2`` to
``short_tokens``. Which prompts are long, and every length, follow from the request seed: both schedules see
the same distribution. The reward is reverse_text's, so groups have a learning signal and are trained on.

    env.reverse_text.type=longtail_env:LongTail +env.reverse_text.args.long_fraction=0.125
    (PYTHONPATH=benchmarks)
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from asyncrl.config.fields import F
from asyncrl.envs.reverse_text import ReverseText
from asyncrl.rollouts.context import RolloutContext
from asyncrl.rollouts.trajectory import Branch, Rollout


def completion_lengths(seed: int, n: int, max_tokens: int, long_fraction: float, short_tokens: int) -> list[int]:
    """The ``n`` completion lengths of one group (pure)."""
    rng = random.Random(seed)
    if rng.random() < long_fraction:
        return [rng.randint(max(1, 3 * max_tokens // 4), max_tokens) for _ in range(n)]
    return [rng.randint(max(1, short_tokens // 2), min(short_tokens, max_tokens)) for _ in range(n)]


class LongTail(ReverseText):
    @dataclass
    class Args(ReverseText.Args):
        long_fraction: float = F(0.125, "fraction of prompts whose completions run to near max_tokens", ge=0, le=1)
        short_tokens: int = F(64, "the other completions are short_tokens/2 to short_tokens long", ge=2)

    async def rollouts(self, ctx: RolloutContext, example: dict[str, Any], n: int, seed: int | None) -> list[Rollout]:
        s, a = ctx.sampling, self.args
        base = seed if seed is not None else random.randrange(2**62)
        lengths = completion_lengths(base, n, s.max_tokens, a.long_fraction, a.short_tokens)
        outs = await asyncio.gather(
            *(
                ctx.pool.chat(self.prompt(example), 1, s.temperature, s.top_p, m, (base + i) % 2**63)
                for i, m in enumerate(lengths)
            )
        )
        choices = [o.choices[0] for o in outs]
        rewards = await asyncio.gather(*(ctx.scorer.score(self.reward, example, c.text) for c in choices))
        return [
            Rollout(
                [Branch(o.prompt_ids, c.token_ids, c.logprobs, [True] * len(c.token_ids))],
                r,
                c.text,
                c.finish_reason,
            )
            for o, c, r in zip(outs, choices, rewards, strict=True)
        ]
