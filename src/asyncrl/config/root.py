"""The root config and the cross-component invariants.

One tree serves every command (``prepare``, ``sft``, ``rl``, ``serve``, ``orchestrate``, ``train``,
``eval``): an experiment file describes a whole pipeline (data, SFT warmup, RL, eval) and DVC will
version one parameter tree. Each process reads only its sections; the invariants that tie sections
together are checked here, in one place, with the names of the keys involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from asyncrl.config.fields import ConfigError, F, validate
from asyncrl.config.inference import InferenceConfig, WeightsConfig
from asyncrl.config.model import ModelConfig
from asyncrl.config.orchestrator import EnvSpec, EvalConfig, OrchestratorConfig
from asyncrl.config.run import LauncherConfig, MonitorConfig
from asyncrl.config.trainer import CkptConfig, DistillConfig, SFTConfig, TrainerConfig
from asyncrl.numerics import MODES


@dataclass
class Config:
    name: str = F("default", "experiment name; names the output directory")
    output_dir: str = F("outputs/${name}", "root of this experiment's outputs")
    data_dir: str = F("outputs/data", "task data written by `asyncrl prepare`, one folder per environment")
    run_dir: str = F("${output_dir}/rl", "RL run directory (configs, logs, rollouts, weights, checkpoints, metrics)")
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
        False, "torch deterministic algorithms in fast mode (e.g. on GPU); reproducible mode turns them on anyway"
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


def check_config(cfg: Config) -> Config:
    """Field bounds plus the invariants that span sections. Returns ``cfg`` for chaining."""
    validate(cfg)
    if cfg.numerics is None:  # resolved here, so every saved config names the mode it ran in
        cfg.numerics = "fast" if uses_gpu(cfg) else "reproducible"
    errors = []
    if not cfg.env:
        errors.append("env is empty; choose at least one environment, e.g. env=[reverse_text]")
    if cfg.orchestrator.max_tokens >= cfg.seq_len:
        errors.append(
            f"orchestrator.max_tokens={cfg.orchestrator.max_tokens} must be < seq_len={cfg.seq_len} "
            "(a prompt and its completion must fit in one packed row)"
        )
    if cfg.trainer.keep_weights < cfg.async_level + 2:
        errors.append(
            f"trainer.keep_weights={cfg.trainer.keep_weights} must be >= async_level + 2 = "
            f"{cfg.async_level + 2} (the orchestrator may still need that many policies)"
        )
    diff = cfg.orchestrator.difficulty
    if (diff.enabled or diff.skip_steps > 0) and diff.min_reward > diff.max_reward:
        errors.append(
            f"orchestrator.difficulty.min_reward={diff.min_reward} must be <= "
            f"orchestrator.difficulty.max_reward={diff.max_reward} (every group would be dropped)"
        )
    if cfg.trainer.behavior_kl and cfg.orchestrator.schedule == "continuous":
        errors.append(
            "trainer.behavior_kl=true needs orchestrator.schedule=step: under 'continuous' a batch mixes policies "
            "and a completion may span a weight update, so no one policy sampled it"
        )
    lora = cfg.model.lora
    if lora.enabled and cfg.weights.transport != "filesystem":
        errors.append(
            f"model.lora.enabled=true needs weights.transport=filesystem (got {cfg.weights.transport!r}): the "
            "hand-off is the adapter, a few MB, which vLLM loads as a LoRA from its directory"
        )
    if lora.enabled and not lora.target_modules:
        errors.append("model.lora.target_modules is empty; name the layers to adapt, e.g. ['q_proj', 'v_proj']")
    if lora.enabled and cfg.inference.backend == "vllm" and lora.r > 512:
        errors.append(f"model.lora.r={lora.r} is above vLLM's largest LoRA rank, 512")
    kl = cfg.trainer.kl
    if kl.target_kl > 0 and kl.beta == 0:
        errors.append(
            f"trainer.kl.target_kl={kl.target_kl} needs trainer.kl.beta > 0: the starting beta the controller adapts "
            "(0 stays 0)"
        )
    fab = cfg.trainer.fabric
    if fab.gpus and len(fab.gpus.split(",")) != fab.devices:
        errors.append(
            f"trainer.fabric.gpus={fab.gpus!r} names {len(fab.gpus.split(','))} GPU(s) but "
            f"trainer.fabric.devices={fab.devices}"
        )
    if fab.precision == "bf16-mixed" and fab.strategy == "auto" and fab.accelerator == "cpu":
        errors.append("trainer.fabric.precision=bf16-mixed is for GPUs; use 32-true on CPU")
    errors += nccl_errors(cfg)
    errors += ipc_errors(cfg)
    errors += numerics_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    resume_step(cfg)
    return cfg


def uses_gpu(cfg: Config) -> bool:
    """Whether a process of this config is meant for a GPU (the hf sidecar takes one when it finds one,
    unless numerics=reproducible keeps it on the CPU)."""
    return (
        cfg.trainer.fabric.accelerator != "cpu"
        or cfg.inference.backend == "vllm"
        or bool(cfg.inference.gpus)
        or bool(cfg.trainer.fabric.gpus)
    )


def numerics_errors(cfg: Config) -> list[str]:
    """Why the ``numerics`` mode asked for cannot hold for this config (empty when it can, or for ``fast``)."""
    if cfg.numerics == "bitwise":
        return bitwise_errors(cfg)
    if cfg.numerics != "reproducible":
        return []
    errors = []
    if uses_gpu(cfg):
        errors.append(
            f"numerics=reproducible pins CPU kernels and cannot hold on a GPU (trainer.fabric.accelerator="
            f"{cfg.trainer.fabric.accelerator}, trainer.fabric.gpus={cfg.trainer.fabric.gpus!r}, inference.backend="
            f"{cfg.inference.backend}, inference.gpus={list(cfg.inference.gpus)}): use numerics=fast"
        )
    if cfg.trainer.fabric.num_threads < 1:
        errors.append(
            "trainer.fabric.num_threads=0 takes the machine's core count, so results would depend on the "
            "machine; numerics=reproducible needs a fixed count >= 1 (or use numerics=fast)"
        )
    if cfg.inference.num_threads != 1:
        errors.append(
            f"inference.num_threads={cfg.inference.num_threads}: numerics=reproducible needs 1, because with "
            "more threads a request's logprobs depend on what shares its batch (or use numerics=fast)"
        )
    if cfg.trainer.fabric.compile:
        errors.append(
            "trainer.fabric.compile=true: Inductor's CPU code depends on the machine's vector ISA, so numerics="
            "reproducible cannot hold; set numerics=fast (or trainer.fabric.compile=false)"
        )
    return errors


# sampling options that change vLLM's processed logits in ways the trainer's forward does not redo
BITWISE_SAMPLING_REFUSED = (
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
    "allowed_token_ids", "min_tokens",
)  # fmt: skip


# vLLM flags that change the kernels or roundings the bitwise forward reproduces
BITWISE_VLLM_FLAGS_REFUSED = (
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--compilation-config", "-cc",
    "--attention-backend", "--kv-cache-dtype", "--quantization", "-q", "--dtype", "--enable-lora",
)  # fmt: skip


def bitwise_errors(cfg: Config) -> list[str]:
    """Why ``numerics=bitwise`` (train = inference bit for bit, see asyncrl/models/bitwise.py) cannot hold."""
    errors = []
    if cfg.trainer.fabric.accelerator != "cuda":
        errors.append(
            f"trainer.fabric.accelerator={cfg.trainer.fabric.accelerator!r}: numerics=bitwise runs the trainer on "
            "vLLM's GPU kernels, set it to 'cuda' (on CPU, numerics=reproducible gives bitwise-reproducible runs)"
        )
    if cfg.inference.backend != "vllm":
        errors.append(
            f"numerics=bitwise reproduces vLLM's forward: inference.backend={cfg.inference.backend!r} must be 'vllm'"
        )
    if cfg.model.dtype != "bfloat16":
        errors.append(f"numerics=bitwise computes in bfloat16 as vLLM does: model.dtype={cfg.model.dtype!r}")
    if cfg.model.lora.enabled:
        errors.append("numerics=bitwise with model.lora.enabled=true: vLLM's LoRA kernels are not reproduced")
    if cfg.trainer.fabric.compile:
        errors.append(
            "numerics=bitwise with trainer.fabric.compile=true: the bitwise forward runs vLLM's own kernels, which "
            "Inductor's fusions would change; set trainer.fabric.compile=false"
        )
    if cfg.orchestrator.top_p != 1.0:
        errors.append(
            f"orchestrator.top_p={cfg.orchestrator.top_p}: numerics=bitwise scores the temperature-scaled logits "
            "only (top_p must be 1.0)"
        )
    flags = sorted(
        str(a)
        for a in cfg.inference.vllm.extra_args
        if str(a).split("=")[0] in BITWISE_VLLM_FLAGS_REFUSED or str(a).startswith("-O")
    )
    if flags:
        errors.append(
            f"inference.vllm.extra_args sets {', '.join(flags)}: numerics=bitwise needs vLLM on one GPU with its own "
            "eager kernels, Triton attention and bf16 weights and KV cache, as the trainer reproduces them"
        )
    refused = sorted(set(cfg.orchestrator.extra_body) & set(BITWISE_SAMPLING_REFUSED))
    if refused:
        errors.append(
            f"orchestrator.extra_body sets {', '.join(refused)}: numerics=bitwise scores the temperature-scaled "
            "logits only, so these would make the sidecar's logprobs differ from the trainer's"
        )
    return errors


def streamed_errors(cfg: Config) -> list[str]:
    """What the GPU-to-GPU transports (nccl, ipc) both need."""
    t = cfg.weights.transport
    errors = []
    if cfg.inference.backend != "vllm":
        errors.append(
            f"weights.transport={t} needs inference.backend=vllm (got {cfg.inference.backend!r}); "
            "the hf sidecar loads weights from files only: use weights.transport=filesystem"
        )
    if cfg.trainer.fabric.accelerator == "cpu":
        errors.append(f"weights.transport={t} needs the trainer on CUDA: set trainer.fabric.accelerator=cuda")
    if not cfg.strict_async:
        errors.append(
            f"weights.transport={t} needs strict_async=true: every version sent must be received, so "
            "the orchestrator must load every version in order"
        )
    return errors


def ipc_errors(cfg: Config) -> list[str]:
    """Why this config cannot use the ipc transport (empty when it can, or when it does not ask to)."""
    if cfg.weights.transport != "ipc":
        return []
    from asyncrl.transport.nccl import inference_workers

    errors = streamed_errors(cfg)
    fab, inf = cfg.trainer.fabric, cfg.inference
    if fab.devices != 1 or fab.num_nodes != 1:
        errors.append(
            f"weights.transport=ipc needs a one-process trainer (trainer.fabric.devices={fab.devices}, "
            f"num_nodes={fab.num_nodes}): it shares one buffer on the sidecar's GPU; use weights.transport=nccl "
            "for a trainer on other GPUs"
        )
    # one url is fine: `asyncrl rl` writes its sidecar's into the config every process loads; a server elsewhere
    # is refused by its worker, which checks that the trainer's buffer is on its own GPU
    if len(inf.urls) > 1 or len(inf.gpus) > 1 or inference_workers(cfg) != 1:
        errors.append(
            "weights.transport=ipc needs one sidecar on one GPU (at most one inference.urls or inference.gpus "
            "entry, no tensor parallelism)"
        )
    sidecar_gpu = inf.gpus[0] if inf.gpus else ""
    if sidecar_gpu != fab.gpus:
        errors.append(
            f"weights.transport=ipc needs the trainer on the sidecar's GPU: trainer.fabric.gpus={fab.gpus!r}, "
            f"inference.gpus={list(inf.gpus)!r} (set both to the same GPU, or leave both empty)"
        )
    return errors


def nccl_errors(cfg: Config) -> list[str]:
    """Why this config cannot use the nccl transport (empty when it can, or when it does not ask to)."""
    if cfg.weights.transport != "nccl":
        return []
    errors = streamed_errors(cfg)
    shared = set(cfg.trainer.fabric.gpus.split(",")) & {g for e in cfg.inference.gpus for g in e.split(",")} - {""}
    if shared:
        errors.append(
            f"weights.transport=nccl cannot link processes on the same GPU (GPU {', '.join(sorted(shared))} "
            "is in both trainer.fabric.gpus and inference.gpus): use weights.transport=filesystem"
        )
    return errors
