"""Config of the orchestrator: environments, rollouts, advantages, filters; and `asyncrl eval`.

Torch-free: the CLI imports it to print ``--help``.

Each field is typed, documented in its ``F(doc=...)`` and bounded where it can be; YAML files in ``conf/``
only choose and override values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from asyncrl.config.fields import F


@dataclass
class EnvSpec:
    """One environment of the mixture: ``env.<name>.{type,weight,args}``."""

    type: str = F("reverse_text", "registered environment name, or 'package.module:Class'")
    weight: float = F(1.0, "sampling weight of this environment in the mixture", gt=0)
    args: Dict[str, Any] = F({}, "environment-specific arguments (checked by the environment)")


@dataclass
class DifficultyConfig:
    enabled: bool = F(
        False,
        "drop groups too hard, too easy or too uniform before packing, counted as rollout/filtered_<reason>",
    )
    min_reward: float = F(0.05, "a group whose mean reward is below this is too hard")
    max_reward: float = F(0.95, "a group whose mean reward is above this is too easy")
    min_reward_variance: float = F(0.0, "a group whose reward variance is below this is too uniform", ge=0)
    skip_steps: int = F(
        0,
        "curriculum (on even when enabled=false): an example whose group scored above "
        "max_reward (solved) or below min_reward (hopeless) is not drawn again for this many "
        "steps (history kept in checkpoints); 0 = off",
        ge=0,
    )


@dataclass
class EnvWorkersConfig:
    min: int = F(1, "environment worker processes started with the run (each holds every environment)", ge=0)
    max: int = F(
        4,
        "at most this many: another starts once every one has had reward_workers calls in flight for as "
        "long as a worker takes to start; 0 = rewards and episodes run in the orchestrator's process (a "
        "reward that blocks inside `async def` stalls it, a crash kills it)",
        ge=0,
    )
    retries: int = F(
        1, "further attempts of a reward or episode whose worker died, then it scores 0 (counted)", ge=0
    )


@dataclass
class OrchestratorConfig:
    schedule: str = F(
        "step",
        "'step': each step draws its prompts and waits for all of them (replayable); "
        "'continuous': groups stay in flight all the time and a batch is cut as soon as enough "
        "have finished (never waits for the slowest)",
        choices=("step", "continuous"),
    )
    prompts_per_step: int = F(
        8, "prompts per RL step (continuous: groups per batch, counted after filtering)", ge=1
    )
    group_size: int = F(8, "completions per prompt (the group of the advantage baseline)", ge=1)
    temperature: float = F(1.0, "sampling temperature (the trainer divides logits by it too)", gt=0)
    top_p: float = F(
        1.0,
        "nucleus sampling: the smallest set of tokens holding this much probability (after top_k, min_p); "
        "the trainer scores under the same truncated distribution (trainer.loss.truncated_logprobs)",
        gt=0,
        le=1,
    )
    top_k: int = F(
        0, "sample among the k most likely tokens (ties kept; applied before top_p); 0 = off", ge=0
    )
    min_p: float = F(
        0.0,
        "drop tokens less likely than min_p x the most likely one (applied "
        "first, after temperature); 0 = off",
        ge=0,
        le=1,
    )
    max_tokens: int = F(64, "longest completion", ge=1)
    std_normalize: bool = F(False, "divide advantages by the group's reward std")
    drop_zero_advantage: bool = F(True, "drop groups whose rewards are all equal (no learning signal)")
    difficulty: DifficultyConfig = F(
        DifficultyConfig(), "online difficulty filtering (PRIME-RL's difficulty_filter)"
    )
    max_inflight: int = F(
        0, "continuous: rollout groups kept in flight across all sidecars; 0 = 2 x prompts_per_step", ge=0
    )
    max_off_policy_steps: int = F(
        8,
        "continuous: a group with a token from a policy more than this many steps older than "
        "the batch it would join is dropped (rollout/stale_dropped); in-flight groups that can "
        "no longer make it are cancelled",
        ge=0,
    )
    max_concurrency: int = F(64, "requests in flight to the inference servers", ge=1)
    request_timeout_s: float = F(
        600.0, "HTTP timeout of one completion request (a server that exceeds it leaves rotation)", gt=0
    )
    health_check_s: float = F(
        10.0,
        "every this many seconds each server in rotation must answer /health within as long; one that "
        "misses 3 in a row is hung and leaves rotation like a dead one (0 = no check)",
        ge=0,
    )
    request_retries: int = F(
        3,
        "further attempts of a request whose server failed (sent to another, or to it once it is back)",
        ge=0,
    )
    reward_timeout_s: float = F(10.0, "a reward that takes longer scores 0 and is counted", gt=0)
    max_failed_reward_steps: int = F(
        3, "steps in a row in which every reward raised or timed out before the run stops (0 = never)", ge=0
    )
    reward_workers: int = F(4, "threads scoring completions in each environment worker", ge=1)
    env_workers: EnvWorkersConfig = F(
        EnvWorkersConfig(),
        "processes that run the environments' rewards and episodes, so one that blocks or crashes cannot "
        "stall or kill the orchestrator (a dead one is replaced)",
    )
    weights_poll_s: float = F(0.02, "how often to look for new weights", gt=0)
    wait_timeout_s: float = F(
        3600.0, "fail if the policy needed by a step does not appear in this time", gt=0
    )
    save_samples: bool = F(True, "write every step's samples to samples/step_N.jsonl")
    routed_experts: bool = F(
        False,
        "ask the sidecars for the experts each token was routed to (a mixture of experts; vLLM is started "
        "with --enable-return-routed-experts) and carry them in the rollouts: the trainer logs how often "
        "its routing differs (train/moe_routes_differ) and, with trainer.router_replay, replays them",
    )
    extra_body: Dict[str, Any] = F(
        {},
        "extra fields of every completion request (vLLM sampling extensions the trainer need "
        "not know, e.g. for benchmarks {ignore_eos: true}; sampling settings the trainer "
        "scores with have keys of their own)",
    )


@dataclass
class EvalConfig:
    out_dir: str = F("${output_dir}/eval", "where metrics.json and samples.jsonl go")
    split: str = F("eval", "dataset split to evaluate", choices=("eval", "train"))
    num_examples: int = F(0, "examples per environment; 0 = the whole split", ge=0)
    greedy: bool = F(True, "also score one greedy completion per prompt")
    n: int = F(
        4, "completions per prompt sampled at orchestrator.temperature (for mean reward and pass@k)", ge=1
    )
    pass_threshold: float = F(1.0, "a completion passes when its reward is at least this")
    url: Optional[str] = F(None, "evaluate against this server instead of starting a sidecar")
