"""The invariants that tie config sections together, checked in one place with the names of the keys
involved.

:func:`check_config` runs on every composed config (field bounds, then these); :func:`learning_problems` is
what a run that trains (``rl``, ``orchestrate``, ``train``) must also satisfy to learn anything, checked at
launch by the preflight.
"""

from __future__ import annotations

from asyncrl.config.fields import ConfigError, validate
from asyncrl.config.layout import context_parallel_errors, layout_errors
from asyncrl.config.root import Config, resume_step
from asyncrl.config.variants import LOSSES, TRANSPORTS


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
    ew = cfg.orchestrator.env_workers
    if ew.max and ew.min > ew.max:
        errors.append(
            f"orchestrator.env_workers.min={ew.min} must be <= orchestrator.env_workers.max={ew.max} "
            "(max=0 runs the environments in the orchestrator's process)"
        )
    if cfg.trainer.behavior_kl and cfg.orchestrator.schedule == "continuous":
        errors.append(
            "trainer.behavior_kl=true needs orchestrator.schedule=step: under 'continuous' a batch mixes "
            "policies and a completion may span a weight update, so no one policy sampled it"
        )
    lora, transport = cfg.model.lora, TRANSPORTS.get(cfg.weights.transport)
    if lora.enabled and not transport.adapters:
        carriers = " or ".join(n for n in TRANSPORTS.names() if TRANSPORTS.get(n).adapters)
        errors.append(
            f"model.lora.enabled=true needs weights.transport={carriers}, one that carries adapters (got "
            f"{cfg.weights.transport!r}): the hand-off is the adapter, a few MB, which vLLM loads as a LoRA "
            "from its directory"
        )
    if lora.enabled and not lora.target_modules:
        errors.append(
            "model.lora.target_modules is empty; name the layers to adapt, e.g. ['q_proj', 'v_proj']"
        )
    if lora.enabled and cfg.inference.backend == "vllm" and lora.r > 512:
        errors.append(f"model.lora.r={lora.r} is above vLLM's largest LoRA rank, 512")
    kl = cfg.trainer.kl
    if kl.target_kl > 0 and kl.beta == 0:
        errors.append(
            f"trainer.kl.target_kl={kl.target_kl} needs trainer.kl.beta > 0: the starting beta the "
            "controller adapts (0 stays 0)"
        )
    fab = cfg.trainer.fabric
    if fab.gpus and len(fab.gpus.split(",")) != fab.devices:
        errors.append(
            f"trainer.fabric.gpus={fab.gpus!r} names {len(fab.gpus.split(','))} GPU(s) but "
            f"trainer.fabric.devices={fab.devices}"
        )
    if fab.precision == "bf16-mixed" and fab.strategy == "auto" and fab.accelerator == "cpu":
        errors.append("trainer.fabric.precision=bf16-mixed is for GPUs; use 32-true on CPU")
    errors += sampling_errors(cfg)
    errors += layout_errors(cfg)
    errors += context_parallel_errors(cfg)
    errors += transport.config_errors(cfg)
    errors += LOSSES.get(cfg.trainer.loss.type).config_errors(cfg)
    errors += numerics_errors(cfg)
    errors += moe_errors(cfg)
    errors += checkpointing_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    resume_step(cfg)
    return cfg


# sampling settings with keys of their own: the trainer scores with them, so extra_body may not set them
# behind its back
OWN_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


def truncates(cfg: Config) -> bool:
    """Whether the sidecar samples from a truncated distribution (``orchestrator.top_k``, ``top_p`` or
    ``min_p``)."""
    oc = cfg.orchestrator
    return oc.top_p < 1 or oc.top_k > 0 or oc.min_p > 0


def sampling_errors(cfg: Config) -> list[str]:
    """Sampling settings the trainer would not know of."""
    own = sorted(set(cfg.orchestrator.extra_body) & set(OWN_SAMPLING_KEYS))
    if not own:
        return []
    return [
        f"orchestrator.extra_body sets {', '.join(own)}: set "
        f"orchestrator.{own[0]} instead, so that the trainer "
        "scores each token under the distribution it was sampled from"
    ]


def moe_errors(cfg: Config) -> list[str]:
    """A mixture of experts: a top-k within the experts; the routes the trainer replays come from the
    sidecar."""
    init, errors = cfg.model.init, []
    if init.is_moe and init.num_experts_per_tok > init.num_experts:
        errors.append(
            f"model.init.num_experts_per_tok={init.num_experts_per_tok} exceeds model.init.num_experts="
            f"{init.num_experts}"
        )
    if cfg.trainer.router_replay and not cfg.orchestrator.routed_experts:
        errors.append(
            "trainer.router_replay=true needs orchestrator.routed_experts=true (the routes it replays)"
        )
    if cfg.trainer.router_replay and cfg.trainer.fabric.context_parallel > 1:
        errors.append(
            "trainer.router_replay=true is not implemented with trainer.fabric.context_parallel > 1"
        )
    return errors


def checkpointing_errors(cfg: Config) -> list[str]:
    fabric = cfg.trainer.fabric
    if fabric.activation_checkpointing:
        return []
    errors = []
    if fabric.activation_checkpointing_every > 1:
        errors.append(
            f"trainer.fabric.activation_checkpointing_every={fabric.activation_checkpointing_every} needs "
            "trainer.fabric.activation_checkpointing=true (it says which layers that recomputes)"
        )
    if fabric.activation_checkpointing_saves != "nothing":
        errors.append(
            f"trainer.fabric.activation_checkpointing_saves={fabric.activation_checkpointing_saves} needs "
            "trainer.fabric.activation_checkpointing=true (it says what the recomputed layers keep)"
        )
    return errors


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
    """Why the ``numerics`` mode asked for cannot hold for this config (empty when it can, or for
    ``fast``)."""
    if cfg.numerics == "bitwise":
        return bitwise_errors(cfg)
    if cfg.numerics != "reproducible":
        return []
    errors = []
    if uses_gpu(cfg):
        errors.append(
            "numerics=reproducible pins CPU kernels and cannot hold on a GPU "
            f"(trainer.fabric.accelerator={cfg.trainer.fabric.accelerator}, "
            f"trainer.fabric.gpus={cfg.trainer.fabric.gpus!r}, inference.backend={cfg.inference.backend}, "
            f"inference.gpus={list(cfg.inference.gpus)}): use numerics=fast"
        )
    if cfg.trainer.fabric.num_threads < 1:
        errors.append(
            "trainer.fabric.num_threads=0 takes the machine's core count, so results would depend on the "
            "machine; numerics=reproducible needs a fixed count >= 1 (or use numerics=fast)"
        )
    if cfg.inference.num_threads != 1:
        errors.append(
            f"inference.num_threads={cfg.inference.num_threads}: "
            "numerics=reproducible needs 1, because with "
            "more threads a request's logprobs depend on what shares its batch (or use numerics=fast)"
        )
    if cfg.trainer.fabric.compile:
        errors.append(
            "trainer.fabric.compile=true: Inductor's CPU code depends on the machine's vector ISA, so "
            "numerics=reproducible cannot hold; set numerics=fast (or trainer.fabric.compile=false)"
        )
    return errors


# sampling options that change vLLM's processed logits in ways the trainer's forward does not redo
BITWISE_SAMPLING_REFUSED = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words",
    "allowed_token_ids", "min_tokens",
)  # fmt: skip


# vLLM flags that change the kernels or roundings the bitwise forward reproduces
BITWISE_VLLM_FLAGS_REFUSED = (
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--compilation-config", "-cc",
    "--attention-backend", "--kv-cache-dtype", "--quantization", "-q", "--dtype", "--enable-lora",
)  # fmt: skip


def bitwise_errors(cfg: Config) -> list[str]:
    """Why ``numerics=bitwise`` (train = inference bit for bit, see asyncrl/models/bitwise.py) cannot
    hold."""
    errors = []
    if cfg.trainer.fabric.accelerator != "cuda":
        errors.append(
            f"trainer.fabric.accelerator={cfg.trainer.fabric.accelerator!r}: numerics=bitwise runs the "
            "trainer on vLLM's GPU kernels, set it to 'cuda' (on CPU, numerics=reproducible gives "
            "bitwise-reproducible runs)"
        )
    if cfg.inference.backend != "vllm":
        errors.append(
            "numerics=bitwise reproduces vLLM's forward: "
            f"inference.backend={cfg.inference.backend!r} must be 'vllm'"
        )
    if cfg.model.dtype != "bfloat16":
        errors.append(f"numerics=bitwise computes in bfloat16 as vLLM does: model.dtype={cfg.model.dtype!r}")
    if cfg.model.lora.enabled:
        errors.append(
            "numerics=bitwise with model.lora.enabled=true: vLLM's LoRA kernels are not reproduced"
        )
    if cfg.trainer.fabric.compile:
        errors.append(
            "numerics=bitwise with trainer.fabric.compile=true: the bitwise forward runs vLLM's own "
            "kernels, which Inductor's fusions would change; set trainer.fabric.compile=false"
        )
    if cfg.inference.tensor_parallel != 1:
        errors.append(
            f"inference.tensor_parallel={cfg.inference.tensor_parallel}: "
            "numerics=bitwise reproduces vLLM on one GPU "
            "(tensor parallelism splits its matmuls and reductions)"
        )
    if truncates(cfg) and not cfg.trainer.loss.truncated_logprobs:
        errors.append(
            "trainer.loss.truncated_logprobs=false with orchestrator.top_k/top_p/min_p set: the "
            "trainer would score the full distribution and the sidecar the truncated one; "
            "numerics=bitwise needs both to score the same"
        )
    flags = sorted(
        str(a)
        for a in cfg.inference.vllm.extra_args
        if str(a).split("=")[0] in BITWISE_VLLM_FLAGS_REFUSED or str(a).startswith("-O")
    )
    if flags:
        errors.append(
            f"inference.vllm.extra_args sets {', '.join(flags)}: numerics=bitwise "
            "needs vLLM on one GPU with its own "
            "eager kernels, Triton attention and bf16 weights and KV cache, as the trainer reproduces them"
        )
    refused = sorted(set(cfg.orchestrator.extra_body) & set(BITWISE_SAMPLING_REFUSED))
    if refused:
        errors.append(
            f"orchestrator.extra_body sets {', '.join(refused)}: numerics=bitwise scores the "
            "temperature-scaled logits truncated by orchestrator.top_k/top_p/min_p only, so these would "
            "make the sidecar's logprobs differ from the trainer's"
        )
    return errors


def learning_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: why an RL run of ``cfg`` would train nothing (refused), or learn from no
    reward while it can still learn from a teacher (warned). A group's advantages are its rewards minus their
    mean, so a group of one completion always has zero advantage."""
    oc, errors, warnings = cfg.orchestrator, [], []
    if oc.group_size == 1 and oc.drop_zero_advantage:
        errors.append(
            "orchestrator.group_size=1 with orchestrator.drop_zero_advantage=true: a group of one "
            "completion has zero advantage, so every group is dropped and no step trains anything; set "
            "orchestrator.group_size >= 2 (or, to learn from a teacher only, "
            "orchestrator.drop_zero_advantage=false)"
        )
    d = oc.difficulty
    if oc.group_size == 1 and d.enabled and d.min_reward_variance > 0:
        errors.append(
            "orchestrator.group_size=1 with "
            f"orchestrator.difficulty.min_reward_variance={d.min_reward_variance}: a group of one has "
            "reward variance 0, so every group is filtered out; set orchestrator.group_size >= 2"
        )
    no_reward_signal = oc.group_size == 1 or cfg.trainer.loss.adv_tau == 0
    if no_reward_signal and not errors:
        why = (
            "orchestrator.group_size=1: every advantage is 0"
            if oc.group_size == 1
            else "trainer.loss.adv_tau=0: the policy-gradient term is off"
        )
        if cfg.distill.teacher or cfg.distill.url:
            warnings.append(f"{why}, so the run learns from the teacher (distill.*) only, not from rewards")
        else:
            warnings.append(
                f"{why}, and no teacher is set (distill.teacher): the run learns from no reward; only the "
                "KL terms (trainer.loss.kl_tau, trainer.kl.beta) move the policy"
            )
    return errors, warnings
