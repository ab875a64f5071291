"""``env.<name>.type=verifiers``: any verifiers (0.4.0, ``verifiers.v1``) taskset as an asyncrl environment.

The taskset is loaded with verifiers' own loader (``vf.load_environment``: the taskset's package, its own
``Env`` if it exports one, else ``SingleAgentEnv``), and every episode runs with verifiers' ``TrainClient``
against the sidecars' token route (``/inference/v1/generate``): the client renders each turn to token ids
itself and the trace records exactly the ids the sidecar sampled, with their logprobs. Each trainable branch
of each trace becomes a :class:`~asyncrl.rollouts.trajectory.Branch` (tokens the environment or a tool wrote
are context, never trained on), so packing and the trainer treat it like any other rollout.

Offline by construction: the agents' harness defaults to ``asyncrl_chat`` (verifiers' chat loop, in this
process: ``null`` would fetch ``uv`` from the network for every episode), the runtime to ``subprocess``
(``prime``, verifiers' default, is a hosted sandbox), and the renderer is named explicitly (left to
auto-resolve, ``renderers`` would query the hub for an unknown model).

``asyncrl prepare`` writes one row per task: a seeded shuffle of the taskset's tasks, the first ``num_eval``
for the eval split; each row keeps the task's index and content hash, and a row whose task changed since
(the taskset package was edited) is refused rather than trained on silently.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import verifiers.v1 as vf
from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import TypeAdapter, ValidationError
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.types import Messages
from verifiers.v1.utils.loaders import resolve_env_config, taskset_config_type

from asyncrl.config.fields import ConfigError, F, unknown_key
from asyncrl.envs.base import Environment
from asyncrl.rollouts.context import RolloutContext, Sampling
from asyncrl.rollouts.trajectory import Branch, Rollout, lost_episode, mean_by_name, split_stream

log = logging.getLogger("asyncrl.envs")


def _plain(value: Any) -> Any:
    """An OmegaConf container (env args come from Hydra) as plain dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def trace_metrics(traces: list[Any]) -> dict[str, float]:
    """Each reward function's score (unweighted) and each metric of an episode, averaged over its trainable
    agents' traces: what the orchestrator and ``asyncrl eval`` report per environment."""
    # a None reward or metric: scoring did not run (it failed, counted elsewhere)
    scores = ({n: None if r is None else r.score for n, r in t.rewards.items()} | t.metrics for t in traces)
    return mean_by_name(scores)


def trace_branches(trace: Any) -> list[Branch]:
    """The training branches of a verifiers trace (one per trainable branch, as PRIME-RL's trajectories do):
    its token ids, with the sampled tokens as the mask and their logprobs. A sampled message shared by
    several branches (the turns before a fork) is trained once, in the first branch that holds it."""
    if not getattr(trace.agent, "trainable", True):
        return []
    out, trained = [], set()
    for b in trace.branches:
        if not b.trainable:
            continue
        mask: list[bool] = []
        for node in b.nodes:
            sampled = any(node.mask)
            mask.extend([False] * len(node.mask) if sampled and id(node) in trained else node.mask)
            if sampled:
                trained.add(id(node))
        branch = split_stream(b.token_ids, mask, b.logprobs)
        if branch is not None:
            out.append(branch)
    return out


def scoring_failed(trace: Any) -> str | None:
    """``"error"`` if a reward raised, ``"timeout"`` if scoring ran out of time, else ``None``."""
    if trace.stop_condition == "scoring_timeout":
        return "timeout"
    if any("scoring" in (e.message or "") for e in trace.errors):
        return "error"
    return None


class VerifiersEnv(Environment):
    @dataclass
    class Args:
        taskset: str = F("", "verifiers taskset id: an installed package exporting a vf.Taskset via __all__")
        taskset_args: dict = F({}, "the taskset config's fields (its TasksetConfig subclass)")
        env_id: str = F(
            "", "a verifiers Env to pair with the taskset ('' = the taskset's own, else SingleAgentEnv)"
        )
        harness: str = F(
            "asyncrl_chat", "harness of the agents that name none (or name 'null', which is not offline)"
        )
        renderer: dict = F(
            {"name": "default"}, "renderers' RendererConfig ('default' = the tokenizer's template)"
        )
        max_turns: int = F(8, "model turns per episode at most", ge=1)
        num_eval: int = F(50, "tasks held out for the eval split (after a seeded shuffle)", ge=0)
        episode_timeout_s: float = F(600.0, "an episode's deadline; past it the episode scores 0", gt=0)

    # the deadline of a trace's scoring (its @vf.reward methods): orchestrator.reward_timeout_s, taken from
    # the first rollouts' context; a reward past it scores 0 and is counted
    scoring_timeout_s = 30.0

    def __init__(self, name, data_dir, args=None):
        super().__init__(name, data_dir, args)
        # loaded now: a taskset that cannot load stops every command before it starts
        self.vf_env  # noqa: B018

    def check_args(self, args) -> list[str]:
        return (
            [] if args.taskset else ["taskset is empty: name a verifiers taskset id (an installed package)"]
        )

    # -- verifiers objects (built once per environment, when it is constructed)
    # ------------------------------
    @cached_property
    def vf_env(self):
        a = self.args
        raw: dict[str, Any] = {"taskset": {"id": a.taskset, **_plain(a.taskset_args)}}
        if a.env_id:
            raw["id"] = a.env_id
        try:
            cls = vf.env_config_type(a.taskset, a.env_id)
        except (ImportError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(
                f"invalid config:\n  env.{self.name}.args.taskset={a.taskset!r}: {e}"
            ) from None
        for role, field in cls.model_fields.items():  # every agent: offline harness and runtime, our limits
            default = field.get_default(call_default_factory=True)
            if isinstance(default, vf.AgentConfig):
                # the env's own settings for the role (a judge's model, a user's turn cap...) stay
                mine = default.model_dump(mode="json", exclude_unset=True)
                harness = default.harness.id if default.harness is not None else None
                raw[role] = {
                    **mine,
                    "harness": {
                        **mine.get("harness", {}),
                        "id": a.harness if harness in (None, "null") else harness,
                    },
                    "runtime": {"type": "subprocess"},
                    "max_turns": min(default.max_turns or a.max_turns, a.max_turns),
                    "timeout": {**mine.get("timeout", {}), "scoring": self.scoring_timeout_s},
                }
        raw["timeout"] = {"episode": a.episode_timeout_s}
        try:
            return vf.load_environment(resolve_env_config(raw))
        except ValidationError as e:  # the env config's fields, the taskset's arguments among them
            raise ConfigError("invalid config:\n  " + "\n  ".join(self._arg_errors(e))) from None
        except Exception as e:  # the loader's import errors, a taskset's own checks: a config mistake
            raise ConfigError(
                f"invalid config:\n  env.{self.name}.args: verifiers cannot load it: {e}"
            ) from None

    def _arg_errors(self, error: ValidationError) -> list[str]:
        """pydantic's errors for the env config as the project's: the key under ``env.NAME.args``, the value,
        and for an unknown taskset argument the allowed names and the closest."""
        allowed = [f for f in taskset_config_type(self.args.taskset).model_fields if f != "id"]
        section = f"env.{self.name}.args.taskset_args"
        lines = []
        for err in error.errors():
            loc = [str(p) for p in err["loc"]]
            if loc[:1] == ["taskset"] and len(loc) > 1:
                if err["type"] == "extra_forbidden" and len(loc) == 2:
                    lines.append(unknown_key(section, loc[1], allowed))
                    continue
                key = f"{section}.{'.'.join(loc[1:])}"
            else:
                key = f"env.{self.name}.args (verifiers' {'.'.join(loc) or 'env config'})"
            lines.append(f"{key}={err.get('input')!r}: {err['msg']}")
        return lines

    @cached_property
    def tasks(self) -> list:
        return list(self.vf_env.taskset)

    # -- data -------------------------------------------------------------------------------------------
    def generate(self, split: str, seed: int) -> list[dict[str, Any]]:
        tasks = self.tasks
        if len(tasks) <= self.args.num_eval:
            raise ValueError(
                f"env.{self.name}: taskset {self.args.taskset!r} has {len(tasks)} tasks; num_eval="
                f"{self.args.num_eval} leaves none to train on"
            )
        order = list(range(len(tasks)))
        random.Random(f"{seed}:{self.name}").shuffle(order)
        chosen = order[: self.args.num_eval] if split == "eval" else order[self.args.num_eval :]
        return [
            {"id": f"{split}-{k}", "index": i, "hash": tasks[i].hash, "prompt": tasks[i].data.prompt_text}
            for k, i in enumerate(chosen)
        ]

    def task(self, example: dict[str, Any]):
        tasks = self.tasks
        i = example["index"]
        if not (0 <= i < len(tasks)) or tasks[i].hash != example["hash"]:
            raise ValueError(
                f"env.{self.name}: task {example['id']} (index {i}) is not the one `asyncrl prepare` wrote: "
                f"the taskset {self.args.taskset!r} changed since; run `asyncrl prepare` again"
            )
        return tasks[i]

    # -- task -------------------------------------------------------------------------------------------
    def prompt(self, example: dict[str, Any]) -> list[dict[str, str]]:
        data = self.task(example).data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return messages + [{"role": "user", "content": data.prompt}]
        return messages + [message_to_wire(m) for m in data.prompt or []]

    def reward(self, example: dict[str, Any], completion: str) -> float:
        raise NotImplementedError("a verifiers environment scores whole episodes (its @vf.reward methods)")

    def answer(self, example: dict[str, Any]) -> str | None:
        """The task's ``answer`` field, if its data has one (SFT needs it)."""
        answer = getattr(self.task(example).data, "answer", None)
        return answer if isinstance(answer, str) else None

    def demonstration(self, example: dict[str, Any]) -> list[dict[str, str]] | None:
        """The task's ``completion`` field if its data has one (a reference episode after the prompt, as chat
        messages: PRIME-RL's SFT format), else its ``answer`` as the one reply."""
        completion = getattr(self.task(example).data, "completion", None)
        if completion is None:
            return super().demonstration(example)
        try:
            messages = TypeAdapter(Messages).validate_python(completion)
        except ValueError as e:
            raise ValueError(
                f"env.{self.name}: task {example['id']} has a malformed `completion`: {e}"
            ) from None
        return [message_to_wire(m) for m in messages]

    # -- episodes ---------------------------------------------------------------------------------------
    async def rollouts(
        self, ctx: RolloutContext, example: dict[str, Any], n: int, seed: int | None
    ) -> list[Rollout]:
        """``n`` episodes of ``example``, each where the environments' code runs (an env worker process, see
        :meth:`episode`), on the sidecar with the fewest episodes in flight."""
        self.task(example)  # a task changed since `asyncrl prepare` is refused here, before anything runs
        seeds = [None if seed is None else (seed + i) % 2**63 for i in range(n)]
        return list(await asyncio.gather(*(self._remote_episode(ctx, example, s) for s in seeds)))

    async def _remote_episode(
        self, ctx: RolloutContext, example: dict[str, Any], seed: int | None
    ) -> Rollout:
        # the worker's deadline: verifiers' own (the episode's, then its scoring's) and a margin for the hop
        deadline_s = self.args.episode_timeout_s + ctx.scorer.timeout_s + 30.0
        rollout = await self.remote_episode(ctx, example, ctx.tokenizer, seed, deadline_s)
        if rollout is None:
            return lost_episode()
        failures = rollout.info.pop("scoring_failures", [])
        ctx.scorer.errors += failures.count("error")
        ctx.scorer.timeouts += failures.count("timeout")
        if rollout.info.pop("broken", False):
            ctx.scorer.episode_errors += 1
        return rollout

    async def episode(
        self,
        example: dict[str, Any],
        url: str,
        s: Sampling,
        model: str,
        tokenizer: str,
        scoring_timeout_s: float,
        seed: int | None,
    ) -> Rollout:
        """One episode on the sidecar at ``url``, run by verifiers on this process's event loop (in an env
        worker, one of its own). Its traces' scoring failures and whether it broke are in ``info``
        (``scoring_failures``, ``broken``), for the orchestrator to count."""
        if scoring_timeout_s != self.scoring_timeout_s and getattr(self, "_served", None) is None:
            self.scoring_timeout_s = scoring_timeout_s
            # rebuilt with this deadline (the tasks, already loaded, are kept)
            self.__dict__.pop("vf_env", None)
        await self._serving()
        # top_k and min_p pass through SamplingConfig (extra="allow") into the token route's sampling_params
        sampling = vf.SamplingConfig(
            temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, **s.truncation()
        )
        if seed is not None:
            sampling = sampling.model_copy(update={"seed": seed})
        client = vf.TrainClientConfig(
            base_url=f"{url}/v1",
            api_key_var="ASYNCRL_SIDECAR_KEY",  # unset: "EMPTY"; the sidecar's generate route needs none
            renderer=_plain(self.args.renderer),
            renderer_model_name=tokenizer,
        )
        episode = await self.vf_env.run_episode(self.task(example), vf.ModelContext(model, client, sampling))
        return self._rollout(episode)

    async def _serving(self) -> None:
        """Enter the env's serving context once (its interception server, shared tools) for this event
        loop."""
        if getattr(self, "_served", None) is None:
            self._served = self.vf_env.serving()
            await self._served.__aenter__()

    async def close(self) -> None:
        if getattr(self, "_served", None) is not None:
            served, self._served = self._served, None
            await served.__aexit__(None, None, None)

    def _rollout(self, episode) -> Rollout:
        traces = [t for t in episode.traces if getattr(t.agent, "trainable", True)]
        failures = [f for t in traces if (f := scoring_failed(t))]
        errors = [e.message for e in episode.errors] + [e.message for t in traces for e in t.errors]
        broken = (
            not traces or any(not t.ok and not scoring_failed(t) for t in traces) or bool(episode.errors)
        )
        if broken:  # the episode itself failed (the model call, the env's code): nothing to learn from
            log.warning(
                f"env {self.name}: an episode failed ({errors[-1] if errors else 'no trace'}); scoring 0"
            )
        reward = 0.0 if broken or failures else sum(t.reward or 0.0 for t in traces) / len(traces)
        last = traces[-1] if traces else None
        return Rollout(
            branches=[] if broken else [b for t in traces for b in trace_branches(t)],
            reward=float(reward),
            text=(last.last_reply or "") if last else "",
            finish_reason="length" if last is not None and last.is_truncated else "stop",
            info={
                "turns": sum(t.num_turns for t in traces),
                "errors": errors,
                "stop": last.stop_condition if last else None,
                "metrics": {} if broken else trace_metrics(traces),
                # every message of the episode (the final branch of each trainable agent): what samples files
                # show
                "transcript": [message_to_wire(m) for t in traces for m in t.messages],
                "scoring_failures": failures,
                "broken": broken,
            },
        )


__all__ = ["VerifiersEnv", "trace_branches", "trace_metrics"]
