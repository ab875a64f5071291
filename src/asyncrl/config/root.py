"""The root config and the cross-component invariants.

One tree serves every command (``prepare``, ``sft``, ``rl``, ``serve``, ``orchestrate``, ``train``,
``eval``): an experiment file describes a whole pipeline (data, SFT warmup, RL, eval) and DVC will
version one parameter tree. Each process reads only its sections; the invariants that tie sections
together are checked in one place, :mod:`asyncrl.config.invariants`, with the names of the keys involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from asyncrl.config.fields import ConfigError, F
from asyncrl.config.inference import InferenceConfig, WeightsConfig
from asyncrl.config.model import ModelConfig
from asyncrl.config.orchestrator import EnvSpec, EvalConfig, OrchestratorConfig
from asyncrl.config.run import LauncherConfig, MonitorConfig
from asyncrl.config.trainer import CkptConfig, DistillConfig, SFTConfig, TrainerConfig

# the kernel modes of ``numerics`` (asyncrl/numerics.py applies them)
MODES = ("reproducible", "fast", "bitwise")


@dataclass
class Config:
    name: str = F("default", "experiment name; names the output directory")
    output_dir: str = F("outputs/${name}", "root of this experiment's outputs")
    data_dir: str = F("outputs/data", "task data written by `asyncrl prepare`, one folder per environment")
    run_dir: str = F(
        "${output_dir}/rl", "RL run directory (configs, logs, rollouts, weights, checkpoints, metrics)"
    )
    seed: int = F(0, "the one seed every process derives its generators from", ge=0)
    numerics: Optional[str] = F(
        None,
        "kernels: 'reproducible' = the same bits on every x86-64 CPU with AVX2 "
        "(pinned kernels, fixed threads; see asyncrl/numerics.py), 'fast' = the "
        "machine's best, 'bitwise' = GPU trainer and vLLM sidecar on the same batch-invariant kernels "
        "(mismatch_kl exactly 0); unset = reproducible on CPU, fast when a GPU is used",
        choices=MODES,
    )
    deterministic: bool = F(
        False,
        "torch deterministic algorithms in fast mode (e.g. on GPU); reproducible mode turns them on anyway",
    )
    max_steps: int = F(20, "total RL steps (a resumed run continues up to this total)", ge=1)
    seq_len: int = F(512, "tokens per packed training row", ge=16)
    async_level: int = F(1, "step n trains on rollouts from policy >= n - async_level (0 = on-policy)", ge=0)
    strict_async: bool = F(
        True,
        "use exactly policy n - async_level, so a seeded run replays bit for bit; "
        "false = the newest allowed policy (timing-dependent); schedule=continuous always takes the newest",
    )
    model: ModelConfig = F(ModelConfig(), "the policy")
    env: Dict[str, EnvSpec] = F({}, "environments by name (a weighted mixture)")
    inference: InferenceConfig = F(InferenceConfig(), "inference sidecar")
    orchestrator: OrchestratorConfig = F(OrchestratorConfig(), "rollouts, rewards, advantages, packing")
    trainer: TrainerConfig = F(TrainerConfig(), "RL trainer")
    distill: DistillConfig = F(DistillConfig(), "online distillation from a teacher model")
    weights: WeightsConfig = F(WeightsConfig(), "policy hand-off from trainer to sidecars")
    sft: SFTConfig = F(SFTConfig(), "SFT warmup")
    eval: EvalConfig = F(EvalConfig(), "evaluation")
    ckpt: CkptConfig = F(CkptConfig(), "checkpoints and resume")
    monitor: MonitorConfig = F(MonitorConfig(), "metrics sinks (JSONL is always on)")
    launcher: LauncherConfig = F(LauncherConfig(), "`asyncrl rl` process supervision")


def resume_step(cfg: Config) -> int | None:
    """``None`` for a fresh run, ``-1`` for 'latest', else the checkpoint step to resume from."""
    value = str(cfg.ckpt.resume).strip().lower()
    if value in ("none", "", "null", "false"):
        return None
    if value == "latest":
        return -1
    if value.isdigit():
        return int(value)
    raise ConfigError(
        f"invalid config:\n  ckpt.resume={cfg.ckpt.resume!r} is not allowed; "
        "allowed values: 'none', 'latest' or a step number"
    )
