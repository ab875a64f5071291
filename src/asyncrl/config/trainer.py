"""Config of the trainer (RL and SFT): optimizer, schedule, loss, KL, distillation, Fabric, checkpoints.

Torch-free: the CLI imports it to print ``--help``.

Each field is typed, documented in its ``F(doc=...)`` and bounded where it can be; YAML files in ``conf/``
only choose and override values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from asyncrl.config.fields import F


@dataclass
class OptimConfig:
    lr: float = F(1e-5, "peak learning rate (AdamW)", gt=0)
    weight_decay: float = F(0.01, "AdamW weight decay", ge=0)
    beta1: float = F(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = F(0.999, "AdamW beta2", ge=0, lt=1)
    eps: float = F(1e-8, "AdamW epsilon", gt=0)
    max_grad_norm: float = F(1.0, "gradient clipping norm; 0 = off", ge=0)


@dataclass
class SchedulerConfig:
    name: str = F(
        "constant", "learning-rate schedule after warmup", choices=("constant", "linear", "cosine")
    )
    warmup_steps: int = F(0, "linear warmup steps", ge=0)
    min_lr_ratio: float = F(0.0, "final lr as a fraction of the peak (linear, cosine)", ge=0, le=1)


# Each built-in loss's own settings, a section named after it (``trainer.loss.<name>.*``); the schema holds
# them, below the losses, so that every process checks a config without importing a loss
@dataclass
class DPPOKLSettings:
    mask_low: float = F(0.2, "mask tokens with A<0 whose prob dropped by more than this", ge=0)
    mask_high: float = F(0.2, "mask tokens with A>0 whose prob rose by more than this", ge=0)


@dataclass
class GRPOSettings:
    clip_low: float = F(0.2, "ratio clipped below at 1 - clip_low", ge=0, lt=1)
    clip_high: float = F(0.28, "ratio clipped above at 1 + clip_high", ge=0)


@dataclass
class GSPOSettings:
    clip_low: float = F(3e-4, "sequence ratio clipped below at 1 - this (the paper's 3e-4)", ge=0, lt=1)
    clip_high: float = F(4e-4, "sequence ratio clipped above at 1 + this (the paper's 4e-4)", ge=0)


@dataclass
class CISPOSettings:
    clip_high: float = F(0.28, "IS weight capped at 1 + this (no lower bound, as MiniMax-M1 runs it)", ge=0)


@dataclass
class LossConfig:
    type: str = F(
        "dppo_kl",
        "RL loss: PRIME-RL's default (DPPO mask + KL), PPO-clip (grpo), GSPO (sequence-level ratio and "
        "clip), CISPO (clipped, stop-gradient IS weight on every token), or your own, "
        "'package.module:Class' (a subclass of asyncrl.losses.base.Loss; docs/extending.md)",
    )
    args: Dict[str, Any] = F({}, "your own loss's settings (checked by the loss; the built-ins take none)")
    adv_tau: float = F(1.0, "weight of the policy-gradient term", ge=0)
    kl_tau: float = F(1e-3, "weight of (log pi - log mu)^2 against the inference policy", ge=0)
    truncated_logprobs: bool = F(
        True,
        "with orchestrator.top_k/top_p/min_p set, score each token under the truncated, renormalised "
        "distribution it was sampled from, as the sidecar's logprobs are; false scores under the full "
        "distribution, which biases every importance ratio by the log of the kept mass",
    )
    dppo_kl: DPPOKLSettings = F(DPPOKLSettings(), "trainer.loss.type=dppo_kl's settings (losses/dppo_kl.py)")
    grpo: GRPOSettings = F(GRPOSettings(), "trainer.loss.type=grpo's settings (losses/grpo.py)")
    gspo: GSPOSettings = F(GSPOSettings(), "trainer.loss.type=gspo's settings (losses/gspo.py)")
    cispo: CISPOSettings = F(CISPOSettings(), "trainer.loss.type=cispo's settings (losses/cispo.py)")


@dataclass
class KLConfig:
    beta: float = F(
        0.0,
        "weight of the KL penalty against the reference (the starting policy, a frozen copy in the trainer; "
        "k3 estimator per loss token); 0 = off, no reference kept",
        ge=0,
    )
    target_kl: float = F(
        0.0,
        "adapt beta after every step toward this KL (Ziegler et al. 2019's "
        "controller); 0 = beta stays fixed",
        ge=0,
    )
    adapt_rate: float = F(
        0.1,
        "adaptive beta: beta *= 1 + adapt_rate * clip(kl_ref / target_kl - 1, -0.2, 0.2) each step",
        gt=0,
    )


@dataclass
class DistillConfig:
    teacher: Optional[str] = F(
        None,
        "online distillation: the teacher (hub id or directory, the student's tokenizer), served by a "
        "sidecar of its own; null = off",
    )
    weight: float = F(
        1.0,
        "weight of the per-token reverse KL to the teacher on the student's sampled tokens (with "
        "trainer.loss.adv_tau=0: on-policy distillation, no reward signal)",
        ge=0,
    )
    url: Optional[str] = F(None, "use this running teacher server (base URL) instead of starting a sidecar")
    gpus: str = F("", "CUDA_VISIBLE_DEVICES of the teacher sidecar in `asyncrl rl`; empty = inherit")


@dataclass
class FabricConfig:
    accelerator: str = F("cpu", "Fabric accelerator", choices=("cpu", "cuda", "auto"))
    devices: int = F(1, "devices per node", ge=1)
    num_nodes: int = F(1, "nodes (multi-node runs start through torchrun/SLURM, which Fabric detects)", ge=1)
    strategy: str = F(
        "auto",
        "'auto' (one device), 'ddp', or 'fsdp2' (FSDP2 sharding, see trainer/parallel.py)",
        choices=("auto", "ddp", "fsdp2"),
    )
    precision: str = F(
        "32-true",
        "'32-true' or 'bf16-mixed' (bf16 compute, fp32 master weights and reductions)",
        choices=("32-true", "bf16-mixed"),
    )
    activation_checkpointing: bool = F(
        False, "recompute each decoder layer in backward (less memory, ~30% more compute)"
    )
    activation_checkpointing_every: int = F(
        1,
        "with activation_checkpointing: recompute one decoder layer in this many, the first of each run (1: "
        "all; 2: every other, so about half the activations are kept and half the recompute is saved), for "
        "the memory that sharded model states leave",
        ge=1,
    )
    activation_checkpointing_saves: str = F(
        "nothing",
        "with activation_checkpointing: what a recomputed layer keeps of its forward (torch's selective "
        "checkpointing). 'nothing': the whole layer runs again in backward; 'matmuls': the outputs of its "
        "matrix multiplies are kept, so backward recomputes only attention and the elementwise work (norms, "
        "RoPE, SiLU); 'matmuls_and_attention': attention's output too, whose recompute grows with the "
        "sample's length (the most memory of the three, the least recompute)",
        choices=("nothing", "matmuls", "matmuls_and_attention"),
    )
    num_threads: int = F(1, "torch CPU threads of the trainer; 0 = torch's default", ge=0)
    compile: bool = F(
        False,
        "torch.compile each decoder layer and the logprob head (fused norms, RoPE, SwiGLU and log-softmax; "
        "the first steps compile); not with numerics=reproducible or bitwise",
    )
    gpus: str = F(
        "",
        "CUDA_VISIBLE_DEVICES of the trainer in `asyncrl rl`, e.g. '1' or '0' "
        "(shares GPU 0); empty = inherit",
    )
    context_parallel: int = F(
        1,
        "ranks that split each sample's sequence (ring attention through torch's context_parallel, "
        "trainer/context.py): one sample per packed row, for samples too long for one GPU; 1 = off",
        ge=1,
    )


@dataclass
class TrainerConfig:
    optim: OptimConfig = F(OptimConfig(), "optimizer")
    scheduler: SchedulerConfig = F(SchedulerConfig(), "learning-rate schedule")
    loss: LossConfig = F(LossConfig(), "RL loss")
    kl: KLConfig = F(KLConfig(), "KL penalty against the reference policy (PRIME-RL's kl_penalty)")
    fabric: FabricConfig = F(FabricConfig(), "Lightning Fabric")
    micro_batch_rows: int = F(
        1,
        "packed rows of seq_len tokens per forward pass (GPUs: 1 long row; CPU: "
        "several short rows, as a block-diagonal mask costs O(seq_len^2) per row)",
        ge=1,
    )
    keep_weights: int = F(
        4, "published weights/step_N kept on disk (those of checkpoints are kept too)", ge=1
    )
    wait_timeout_s: float = F(3600.0, "fail if the rollouts of a step do not appear in this time", gt=0)
    router_replay: bool = F(
        False,
        "a mixture of experts routes each token to the experts the sidecar routed it to "
        "(orchestrator.routed_experts), with routing weights from the trainer's router (its "
        "softmax of those experts, renormalised as the model does): the experts that computed the "
        "sampled logprobs are the ones trained",
    )
    behavior_kl: bool = F(
        False,
        "also score each step's samples under the policy that sampled them and log train/behavior_kl: the "
        "train/inference mismatch without staleness (mismatch_kl includes the policy's change since "
        "sampling when async_level > 0). Costs a no-grad forward a step, a copy of the trainable weights "
        "(serving dtype) per async level, and a transient copy of them while it scores; schedule=step only",
    )
    profile_step: Optional[int] = F(
        None,
        "run this step under torch's profiler on every rank: op tables, a Chrome trace and the step's GPU "
        "time split into computation, collectives and collectives no computation hides, in "
        "<run_dir>/profile (asyncrl/trainer/profile.py); null = off",
        ge=0,
    )


@dataclass
class SFTConfig:
    run_dir: str = F(
        "${output_dir}/sft", "SFT run directory; the trained model is written to <run_dir>/model"
    )
    max_steps: int = F(200, "optimizer steps", ge=1)
    batch_size: int = F(32, "examples per step", ge=1)
    optim: OptimConfig = F(OptimConfig(lr=1e-3), "optimizer")
    scheduler: SchedulerConfig = F(SchedulerConfig(), "learning-rate schedule")


@dataclass
class CkptConfig:
    interval: int = F(0, "checkpoint every N steps; 0 = only at the end", ge=0)
    keep_last: int = F(2, "checkpoints kept on disk", ge=1)
    resume: str = F(
        "none", "'none', 'latest' or a step number: resume the run in run_dir from that checkpoint"
    )
