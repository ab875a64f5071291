"""``reverse_text`` whose reward blocks: one call in ``every`` sleeps ``sleep_s`` synchronously inside an
``async def`` reward, as a careless verifiers reward would
(``python benchmarks/orchestrator_scale.py --slow-reward-every N``). Scores are reverse_text's."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from asyncrl.config.fields import F
from asyncrl.envs.reverse_text import ReverseText


class BlockingReverseText(ReverseText):
    @dataclass
    class Args(ReverseText.Args):
        every: int = F(512, "one reward call in this many blocks", ge=1)
        sleep_s: float = F(1.0, "how long it blocks (time.sleep, inside async def)", ge=0)

    def __init__(self, name, data_dir, args=None):
        super().__init__(name, data_dir, args)
        self.calls = itertools.count()

    async def reward(self, example, completion):
        if next(self.calls) % self.args.every == self.args.every - 1:
            # synchronous, on purpose: it blocks the loop that runs this reward
            time.sleep(self.args.sleep_s)
        return ReverseText.reward(self, example, completion)
