"""An environment whose reward misbehaves on purpose (tests only), loaded by env worker processes by its path
``helpers.misbehaving_env:Misbehaving``. The completion says how: ``sleep`` blocks 1 s in a plain reward,
``async-sleep`` blocks 1 s synchronously inside an ``async def`` one (:meth:`Misbehaving.async_reward`),
``exit`` kills the process running it, ``exit-once`` kills it the first time only (a marker file in
``data_dir``), ``pid`` scores the process's id, ``env`` the number in its ``ASYNCRL_TEST_NUMBER``; anything
else scores reverse_text's reward."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from dataclasses import dataclass

from asyncrl.config.fields import F
from asyncrl.envs.reverse_text import ReverseText


class Misbehaving(ReverseText):
    @dataclass
    class Args(ReverseText.Args):
        fail_in_workers: bool = F(
            False, "raise when built in an env worker process (a worker that cannot start)"
        )
        start_s: float = F(
            0.0, "seconds an env worker process takes to build it (a slow start, as verifiers' imports)"
        )

    def __init__(self, name, data_dir, args=None):
        super().__init__(name, data_dir, args)
        if self.args.fail_in_workers and multiprocessing.parent_process() is not None:
            raise RuntimeError("this environment cannot be built here")
        if multiprocessing.parent_process() is not None:
            time.sleep(self.args.start_s)

    def reward(self, example, completion):
        if completion == "sleep":
            time.sleep(1.0)
            return 1.0
        if completion == "exit":
            os._exit(3)
        if completion == "exit-once":
            marker = self.data_dir / "exited"
            if not marker.exists():
                marker.touch()
                os._exit(3)
            return 0.5
        if completion == "pid":
            return float(os.getpid())
        if completion == "env":
            return float(os.environ.get("ASYNCRL_TEST_NUMBER", "-1"))
        if completion == "parts":  # the share this copy was told of (Environment.share)
            return float(getattr(self, "parts", 1))
        return super().reward(example, completion)

    def share(self, parts: int) -> None:
        self.parts = parts

    async def async_reward(self, example, completion):
        if completion == "async-sleep":
            time.sleep(1.0)  # synchronous, on purpose: it blocks whatever event loop runs this coroutine
            return 1.0
        return self.reward(example, completion)


class AsyncReward(ReverseText):
    """reverse_text with its reward written as ``async def`` (as verifiers-style rewards often are)."""

    async def reward(self, example, completion):
        await asyncio.sleep(0)
        return ReverseText.reward(self, example, completion)
