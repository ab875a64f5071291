"""``asyncrl-reverse-text``: asyncrl's built-in ``reverse_text`` as a verifiers taskset (single-turn).

The same generated texts (asyncrl's generator, same seed and lengths) and the same reward (the longest-
common-subsequence ratio of the reply to the reversed text), so training through verifiers can be compared
with the built-in environment one for one. Taskset id ``asyncrl-reverse-text``; arguments: ``min_len``,
``max_len``, ``num_tasks``, ``seed``, ``instructions``.
"""

from __future__ import annotations

import verifiers.v1 as vf
from pydantic import Field

from asyncrl.envs.reverse_text import ReverseText, lcs_ratio


class ReverseTextConfig(vf.TasksetConfig):
    min_len: int = Field(10, ge=1, description="shortest text, in characters")
    max_len: int = Field(20, ge=1, description="longest text, in characters")
    num_tasks: int = Field(
        2000, ge=1, description="tasks (asyncrl holds env.<name>.args.num_eval of them out)"
    )
    seed: int = Field(
        0, description="the generator's seed (asyncrl's reverse_text with seed=S draws the same texts)"
    )
    instructions: str | None = Field(
        None, description="system message (none: a char-level model needs none)"
    )


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        return lcs_ratio((trace.last_reply or "").strip(), self.data.answer)


class ReverseTextTaskset(vf.Taskset[ReverseTask, ReverseTextConfig]):
    def load(self):
        c = self.config
        gen = ReverseText(
            "reverse_text",
            ".",
            {"min_len": c.min_len, "max_len": c.max_len, "num_train": c.num_tasks, "num_eval": 1},
        )
        for row in gen.generate("train", c.seed):
            yield ReverseTask(
                ReverseData(
                    id=row["id"], prompt=row["text"], system_prompt=c.instructions, answer=row["text"][::-1]
                )
            )


__all__ = ["ReverseTextTaskset"]
