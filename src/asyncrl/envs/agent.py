"""``env.<name>.type=agent``: an agent program, as it is, as the environment.

The program is a Python callable (``args.agent=package.module:function``, ``def`` or ``async def``, called
with the task row and an :class:`~asyncrl.rollouts.calls.Endpoint`) or a command line (``args.command``, run
in a fresh working directory with the task as JSON in ``ASYNCRL_TASK`` and ``task.json``; with
``args.sandbox``, an untrusted one, in a sandbox whose one way out is its endpoint:
:mod:`asyncrl.sandbox.agents`). Either way it talks to the policy through an OpenAI endpoint of its own
rollout on a sidecar (``base_url``/``api_key``/``model``, or for a command ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and the other names of :data:`~asyncrl.rollouts.calls.ENV_NAMES`): every call it makes is
recorded in token ids, whatever framework makes it, and becomes training branches
(:func:`~asyncrl.rollouts.calls.assemble`). The orchestrator's sampling settings apply to every call (an
agent's own temperature would make the recorded logprobs another distribution than the one trained).

``args.reward`` (``package.module:function``) scores the outcome: ``reward(task, outcome)``, where
``outcome`` is what the callable returned, or for a command ``{"returncode", "stdout", "stderr", "workdir"}``
(the directory still holds what the program wrote). ``args.tasks`` (``package.module:function``) gives each
split's rows, ``tasks(split, seed)``. An episode runs in an env worker process (``orchestrator.env_workers``)
with a deadline of ``args.timeout_s``; an agent that raises, exits non-zero or runs past it scores 0, is not
trained on, and is counted (``rollout/agent_errors``, ``rollout/agent_timeouts``), as are calls that started
a stream of their own (``rollout/agent_restarts``) and calls answered without their logprobs
(``rollout/agent_unusable_calls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import shlex
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from asyncrl.config.fields import F
from asyncrl.config.variants import import_path
from asyncrl.envs.base import Environment
from asyncrl.rollouts.answers import TOKEN_VERSIONS
from asyncrl.rollouts.calls import ENV_NAMES, Endpoint, assemble, recorded_rollout
from asyncrl.rollouts.context import RolloutContext, Sampling
from asyncrl.rollouts.trajectory import Rollout, lost_episode
from asyncrl.sandbox.agents import (
    OUTPUT_TAIL,
    AgentLimits,
    outputs_within,
    run_sandboxed,
    sandbox_path_problem,
)
from asyncrl.utils.tempdirs import process_tempdir

log = logging.getLogger("asyncrl.envs")

WORKDIRS_PREFIX = "asyncrl-agent-"  # then the worker's process id


class AgentFailed(Exception):
    """The agent program raised, exited non-zero, or ran past its deadline (``cause``: the count it adds
    to)."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


class Agent(Environment):
    @dataclass
    class Args:
        agent: str = F(
            "", "the agent: a package.module:function (task, endpoint) -> outcome, def or async def"
        )
        command: str = F(
            "", "or the agent as a command line (shell words), its task in $ASYNCRL_TASK and task.json"
        )
        tasks: str = F("", "package.module:function (split, seed) -> the split's task rows (dicts)")
        reward: str = F(
            "", "package.module:function (task, outcome) -> a number in [0, 1], def or async def"
        )
        timeout_s: float = F(
            300.0, "an episode's deadline (the agent's run); past it the episode scores 0", gt=0
        )
        sandbox: bool = F(
            False,
            "run args.command in a sandbox whose one way out is its rollout's /v1 endpoint (no host files, "
            "no network, no sidecar admin routes): an untrusted agent",
        )
        sandbox_paths: list[str] = F(
            [],
            "host paths a sandboxed agent reads (its code, its packages): "
            "bound read-only, on its PYTHONPATH",
        )
        sandbox_memory_mb: int = F(4096, "address space of each process of a sandboxed agent", ge=64)
        demonstration: str = F(
            "",
            "for SFT: package.module:function (task) -> {'messages': the agent's conversation "
            "as it sends it (system, user, then assistant turns with tool_calls and tool "
            "results), 'tools': the tools it offers}",
        )

    _client: httpx.AsyncClient | None = None  # this worker's client of the sidecars' rollout routes
    _workdirs: Path | None = None  # this worker's directory of its commands' working directories

    def check_args(self, args) -> list[str]:
        problems = []
        if bool(args.agent) == bool(args.command):
            problems.append(f"agent={args.agent!r}, command={args.command!r}: give exactly one of them")
        problems += [
            f"{k} is empty: name a package.module:function"
            for k in ("tasks", "reward")
            if not getattr(args, k)
        ]
        if args.sandbox and not args.command:
            problems.append(
                "sandbox=true runs a command line (args.command); a callable runs in the env worker"
            )
        problems += [
            f"sandbox_paths: {p} {why}" for p in args.sandbox_paths if (why := sandbox_path_problem(p))
        ]
        return problems

    def _named(self, key: str) -> Any:
        return import_path(getattr(self.args, key), f"env.{self.name}.args.{key}")

    # -- data and task ----------------------------------------------------------------------------------
    def generate(self, split: str, seed: int) -> list[dict[str, Any]]:
        rows = self._named("tasks")(split, seed)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(
                f"env.{self.name}: {self.args.tasks}({split!r}, {seed}) must return a list of dicts"
            )
        return [{"id": f"{split}-{i}", **row} for i, row in enumerate(rows)]

    def prompt(self, example: dict[str, Any]) -> list[dict[str, str]]:
        """The agent's first messages where ``args.demonstration`` gives them (what SFT trains after); else
        what the samples files show of a task (its ``prompt`` field, else the row): the agent writes its own
        prompts."""
        if (demo := self._demonstrated(example)) is not None:
            return demo[0]
        return [{"role": "user", "content": str(example.get("prompt", json.dumps(example)))}]

    def reward(self, example: dict[str, Any], completion: str) -> float:
        raise NotImplementedError(
            "an agent environment scores whole episodes (args.reward, on the agent's outcome)"
        )

    def demonstration(self, example: dict[str, Any]) -> list[dict[str, Any]] | None:
        demo = self._demonstrated(example)
        return None if demo is None else demo[1]

    def tools(self, example: dict[str, Any]) -> list[dict[str, Any]] | None:
        demo = self._demonstrated(example)
        return None if demo is None else demo[2]

    def _demonstrated(self, example: dict[str, Any]) -> tuple[list, list, list | None] | None:
        """``args.demonstration``'s conversation split at its first assistant message, and its tools."""
        if not self.args.demonstration:
            return None
        demo = self._named("demonstration")(example)
        messages = demo.get("messages") if isinstance(demo, dict) else None
        first = next((i for i, m in enumerate(messages or []) if m.get("role") == "assistant"), None)
        if not messages or not first:
            raise ValueError(
                f"env.{self.name}: {self.args.demonstration}(task {example.get('id')}) must return "
                "{'messages': [...], 'tools': [...]} with the prompt's messages "
                "before the first assistant message"
            )
        return messages[:first], messages[first:], demo.get("tools") or None

    # -- episodes (the orchestrator's side) -------------------------------------------------------------
    async def rollouts(
        self, ctx: RolloutContext, example: dict[str, Any], n: int, seed: int | None
    ) -> list[Rollout]:
        seeds = [None if seed is None else (seed + 1000 * i) % 2**63 for i in range(n)]
        return list(await asyncio.gather(*(self._remote_episode(ctx, example, s) for s in seeds)))

    async def _remote_episode(
        self, ctx: RolloutContext, example: dict[str, Any], seed: int | None
    ) -> Rollout:
        deadline_s = self.args.timeout_s + ctx.scorer.timeout_s + 30.0  # the agent's, its reward's, the hops
        headers = dict(ctx.pool.http.headers)  # the admin token, if the sidecars need one
        rollout = await self.remote_episode(ctx, example, headers, seed, deadline_s)
        if rollout is None:
            return lost_episode()
        counts = rollout.info.pop("counts", {})
        # the group's staleness, from the tokens' own versions
        if (versions := TOKEN_VERSIONS.get()) is not None:
            versions.update(rollout.info.pop("versions", {}))
        ctx.scorer.errors += counts.pop("reward_errors", 0)
        ctx.scorer.timeouts += counts.pop("reward_timeouts", 0)
        ctx.scorer.count(counts)
        return rollout

    # -- an episode (in an env worker) --------------------------------------------------------------------
    async def episode(
        self,
        example: dict[str, Any],
        url: str,
        s: Sampling,
        model: str,
        headers: dict[str, str],
        reward_timeout_s: float,
        seed: int | None,
    ) -> Rollout:
        """One run of the agent on the sidecar at ``url``, scored: its branches, or none if it failed."""
        sampling = {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens,
            **s.truncation(),
        }
        ttl_s = self.args.timeout_s + 60.0
        counts: dict[str, int] = {}
        outcome, failure, reward = None, None, 0.0
        with self._workdir() as workdir:
            opened = recorded_rollout(self._http(headers), url, model, ttl_s, sampling, seed)
            async with opened as (endpoint, recorded):
                try:
                    outcome = await self._run_agent(example, endpoint, workdir)
                except AgentFailed as e:
                    failure = e
                    counts[e.cause] = 1
            if failure is None:
                reward, cause = await _score(self._named("reward"), example, outcome, reward_timeout_s)
                if cause:
                    counts[cause] = 1
        branches, restarts = assemble(recorded.calls)
        counts |= {
            k: v for k, v in (("agent_restarts", restarts), ("agent_unusable_calls", recorded.unusable)) if v
        }
        rollout = self._rollout(recorded.calls, branches if failure is None else [], reward, failure, counts)
        if failure is None:
            rollout.info["versions"] = token_versions(recorded.calls)
        return rollout

    def _rollout(self, calls, branches, reward, failure, counts) -> Rollout:
        last = calls[-1] if calls else {}
        reply = last.get("reply") or {}
        if failure is not None:
            log.warning(f"env {self.name}: {failure}; scoring 0")
        return Rollout(
            branches=branches,
            reward=float(reward),
            text=reply.get("content") or "",
            finish_reason=last.get("finish_reason") or "stop",
            info={
                "turns": len(calls),
                "stop": failure.cause if failure else "done",
                "errors": [str(failure)] if failure else [],
                "transcript": [*(last.get("messages") or []), reply] if last else [],
                "counts": counts,
            },
        )

    @contextlib.contextmanager
    def _workdir(self) -> Iterator[str | None]:
        """A command's fresh working directory, until its episode is scored (none for a callable). They live
        in one directory of this worker's, which :meth:`close` removes, as does the next worker if this one
        is killed."""
        if not self.args.command:
            yield None
            return
        if self._workdirs is None:
            self._workdirs = process_tempdir(WORKDIRS_PREFIX)
            # a sandbox's user (nobody, when we are root) passes through to its own
            self._workdirs.chmod(0o711)
        with tempfile.TemporaryDirectory(dir=self._workdirs) as workdir:
            yield workdir

    async def _run_agent(self, example: dict[str, Any], endpoint: Endpoint, workdir: str | None) -> Any:
        """The agent's outcome; :class:`AgentFailed` if it raised, exited non-zero or ran past its
        deadline."""
        timeout_s = self.args.timeout_s
        if workdir is not None:
            limits = AgentLimits(memory_mb=self.args.sandbox_memory_mb) if self.args.sandbox else None
            paths = tuple(self.args.sandbox_paths)
            return await _run_command(
                self.args.command, example, endpoint, workdir, timeout_s, limits, paths
            )
        fn = self._named("agent")
        call = (
            fn(example, endpoint)
            if inspect.iscoroutinefunction(fn)
            else asyncio.to_thread(fn, example, endpoint)
        )
        try:
            return await asyncio.wait_for(call, timeout_s)
        except TimeoutError:
            raise AgentFailed("agent_timeouts", f"the agent ran past args.timeout_s={timeout_s:g}") from None
        except Exception as e:  # the agent's own failure: the episode's, never the worker's
            raise AgentFailed("agent_errors", f"the agent raised {type(e).__name__}: {e}") from None

    def _http(self, headers: dict[str, str]) -> httpx.AsyncClient:
        """This worker's client of the sidecars' rollout routes (one per event loop)."""
        if self._client is None:
            self._client = httpx.AsyncClient(headers=headers, timeout=60.0)
        return self._client

    async def close(self) -> None:
        if self._workdirs is not None:  # the episodes still running are abandoned: the worker ends next
            shutil.rmtree(self._workdirs, ignore_errors=True)
            self._workdirs = None
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def token_versions(calls: list[dict[str, Any]]) -> dict[int, int]:
    """The sampled tokens of ``calls`` by the policy version each came from: the sidecar's count per token
    where it reports one (the built-in backend), else the version it held when the call came in (vLLM: the
    oldest a token of that call can be, so staleness is never under-stated)."""
    versions: Counter[int] = Counter()
    for call in calls:
        per_token = call.get("policy_versions")
        if isinstance(per_token, list) and len(per_token) == len(call["completion_ids"]):
            versions.update(per_token)
        else:
            versions[call.get("version", 0)] += len(call["completion_ids"])
    return dict(versions)


async def _score(
    fn: Any, example: dict[str, Any], outcome: Any, timeout_s: float
) -> tuple[float, str | None]:
    """``fn(example, outcome)`` as a number, and the count a failure adds to (0 if it raises, hangs or is no
    number)."""
    call = (
        fn(example, outcome) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, example, outcome)
    )
    try:
        value = await asyncio.wait_for(call, timeout_s)
        return float(value), None
    except TimeoutError:
        return 0.0, "reward_timeouts"
    except Exception as e:
        log.warning(f"a reward raised {type(e).__name__}: {e}; scoring 0")
        return 0.0, "reward_errors"


async def _run_command(
    command: str,
    example: dict[str, Any],
    endpoint: Endpoint,
    workdir: str,
    timeout_s: float,
    sandbox: AgentLimits | None,
    paths: tuple[str, ...],
):
    """The command's outcome, run in ``workdir``; with ``sandbox``, in a sandbox of those limits, where it
    sees ``workdir`` as /work and ``paths`` read-only."""
    task = json.dumps(example)
    with open(os.path.join(workdir, "task.json"), "w") as f:
        f.write(task)
    argv, env = shlex.split(command), {**endpoint.env(), "ASYNCRL_TASK": task}
    try:
        if sandbox is None:
            code, out, err = await _run_process(argv, env, workdir, timeout_s)
        else:
            code, out, err = await run_sandboxed(
                argv, env, workdir, endpoint.base_url, ENV_NAMES["base_url"], timeout_s, sandbox, paths
            )
    except TimeoutError:
        raise AgentFailed("agent_timeouts", f"the agent ran past args.timeout_s={timeout_s:g}") from None
    stdout, stderr = out.decode(errors="replace")[-OUTPUT_TAIL:], err.decode(errors="replace")[-OUTPUT_TAIL:]
    if code != 0:
        raise AgentFailed("agent_errors", f"the agent exited {code}: {stderr[-500:]}")
    return {"returncode": code, "stdout": stdout, "stderr": stderr, "workdir": workdir}


async def _run_process(
    argv: list[str], env: dict[str, str], workdir: str, timeout_s: float
) -> tuple[int, bytes, bytes]:
    """``argv`` in ``workdir``, its own process group (its children die with it), killed past
    ``timeout_s``."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env={**os.environ, **env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:  # not found, not executable
        raise AgentFailed("agent_errors", f"the agent's command cannot start: {e}") from None
    out, err = await outputs_within(proc, timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out, err
