"""Config sections, one dataclass per component. Torch-free: the CLI imports these to print ``--help``.

Each field is typed, documented in its ``F(doc=...)`` and bounded where it can be; YAML files in
``conf/`` only choose and override values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from asyncrl.config.fields import F

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TinyModelConfig:
    """Architecture that ``asyncrl prepare`` initialises randomly and saves at ``model.name``."""

    build: bool = F(False, "`asyncrl prepare` builds this random-init model (and a char tokenizer) at model.name")
    architecture: str = F(
        "Qwen3ForCausalLM", "transformers architecture class", choices=("Qwen3ForCausalLM", "LlamaForCausalLM")
    )
    hidden_size: int = F(128, "hidden width", ge=8)
    intermediate_size: int = F(384, "MLP width", ge=8)
    num_hidden_layers: int = F(3, "decoder layers", ge=1)
    num_attention_heads: int = F(4, "query heads", ge=1)
    num_key_value_heads: int = F(2, "key/value heads (grouped-query attention)", ge=1)
    head_dim: int = F(32, "per-head width", ge=4)
    max_position_embeddings: int = F(512, "longest sequence the model accepts", ge=16)
    tie_word_embeddings: bool = F(True, "share input and output embeddings")
    charset: str = F(
        "ascii_printable",
        "characters of the local character-level tokenizer",
        choices=("ascii_lowercase", "ascii_printable"),
    )
    vocab_size: int = F(0, "embedding rows; 0 = the tokenizer's size (more only for benchmarks of a real shape)", ge=0)


@dataclass
class LoRAConfig:
    enabled: bool = F(
        False,
        "train LoRA adapters (peft) instead of every weight; the hand-off is the adapter, which vLLM loads as a LoRA "
        "and the built-in sidecar merges on load",
    )
    r: int = F(16, "adapter rank", ge=1)
    alpha: int = F(32, "scale numerator: the update is (alpha / r) * B @ A", ge=1)
    dropout: float = F(
        0.0, "dropout on the adapter's input while training (> 0: trainer and sidecar logprobs differ)", ge=0, lt=1
    )
    target_modules: List[str] = F(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "linear layers adapted, by name suffix (PRIME-RL's default)"
    )


@dataclass
class ModelConfig:
    name: str = F("outputs/models/tiny", "starting policy: a Hugging Face id or a local HF directory")
    tokenizer: Optional[str] = F(None, "tokenizer id or directory; null = same as model.name")
    dtype: str = F("float32", "weights dtype for training and inference", choices=DTYPES)
    attn_implementation: str = F(
        "sdpa",
        "attention kernel; 'varlen' = torch's flash varlen kernel on packed rows (GPU, see models/attention.py), "
        "'varlen_fa4' = flash-attn-4's kernel there (Hopper+, as custom ops a compiled layer keeps whole); "
        "flash_attention_2/3/4 = the flash-attn, flash-attn-3 or flash-attn-4 package (4: training only, transformers "
        "decodes with it without a KV cache kernel)",
        choices=(
            "sdpa",
            "eager",
            "varlen",
            "varlen_fa4",
            "flex_attention",
            "flash_attention_2",
            "flash_attention_3",
            "flash_attention_4",
        ),
    )
    trust_remote_code: bool = F(False, "allow model code from the checkpoint directory")
    init: TinyModelConfig = F(TinyModelConfig(), "random-init architecture built by `asyncrl prepare`")
    lora: LoRAConfig = F(LoRAConfig(), "LoRA adapters instead of full fine-tuning (RL and SFT)")


@dataclass
class EnvSpec:
    """One environment of the mixture: ``env.<name>.{type,weight,args}``."""

    type: str = F("reverse_text", "registered environment name, or 'package.module:Class'")
    weight: float = F(1.0, "sampling weight of this environment in the mixture", gt=0)
    args: Dict[str, Any] = F({}, "environment-specific arguments (checked by the environment)")


@dataclass
class VLLMConfig:
    """The vLLM backend (GPU): vLLM's own OpenAI server with asyncrl's admin routes added."""

    gpu_memory_utilization: float = F(
        0.85, "fraction of the GPU vLLM may take (lower it when the trainer shares the GPU)", gt=0, le=1
    )
    enforce_eager: bool = F(False, "no CUDA graphs / torch.compile: faster start, slower decoding")
    max_model_len: int = F(0, "context length; 0 = the model's", ge=0)
    max_num_seqs: int = F(512, "sequences decoded together", ge=1)
    enable_prefix_caching: bool = F(True, "reuse prompt KV across requests (reset on every weight update)")
    defer_logprobs: bool = F(
        True,
        "send a non-streamed request's sample logprobs once, when it finishes, instead of every decode step "
        "(asyncrl's vLLM plugin: the engine core keeps each step's arrays whole, the frontend reads a request's rows "
        "in bulk; the same numbers; 1.9x the rollout throughput through asyncrl on an H100, see README; "
        "asyncrl/inference/vllm_logprobs.py)",
    )
    extra_args: List[str] = F([], "further vLLM CLI flags, verbatim (e.g. ['--tensor-parallel-size', '2'])")


@dataclass
class InferenceConfig:
    backend: str = F("hf", "inference backend: 'hf' (built-in, CPU or GPU) or 'vllm' (GPU)", choices=("hf", "vllm"))
    gpus: List[str] = F(
        [],
        "one entry per sidecar: its CUDA_VISIBLE_DEVICES, e.g. ['0'], ['0', '1'] (two sidecars) "
        "or ['0,1'] (one sidecar on two GPUs); empty = one sidecar with the default devices",
    )
    host: str = F("127.0.0.1", "address the sidecar binds to (admin routes accept only loopback without a token)")
    port: int = F(
        0,
        "sidecar port; 0 = a free one, chosen at launch (the run's config records it in inference.urls)",
        ge=0,
        le=65535,
    )
    urls: List[str] = F([], "use these running servers (base URLs) instead of starting a sidecar")
    admin_token: Optional[str] = F(None, "bearer token that lets non-loopback clients call admin routes")
    max_batch_size: int = F(256, "most sequences decoded together (a larger request is decoded in parts)", ge=1)
    max_request_rows: int = F(4096, "most sequences one request may ask for (prompts x n); more get a 400", ge=1)
    max_body_mb: float = F(16.0, "largest request body in MiB; a larger one gets a 413 before it is read", gt=0)
    weights_roots: List[str] = F(
        [],
        "directories /update_weights may load from (and below); empty = run_dir and model.name's directory",
    )
    batch_wait_ms: float = F(2.0, "how long the first request waits for others to share its batch", ge=0)
    pad_multiple: int = F(
        64,
        "prompts are left-padded to a multiple of this, so a row's numerics do not "
        "depend on which requests share its batch (seeded runs replay exactly)",
        ge=1,
    )
    num_threads: int = F(1, "torch CPU threads of the sidecar; 0 = torch's default", ge=0)
    engine_process: bool = F(
        True,
        "hf backend: decode in a child process, so the HTTP server keeps the GIL (/health stays prompt); "
        "false = in the server's process (for debuggers and profilers)",
    )
    startup_timeout_s: float = F(180.0, "how long to wait for /health", gt=0)
    log_level: str = F("warning", "uvicorn log level", choices=("debug", "info", "warning", "error"))
    vllm: VLLMConfig = F(VLLMConfig(), "vLLM backend settings")


@dataclass
class WeightsConfig:
    """How each new policy travels from the trainer to the sidecars (see transport/)."""

    transport: str = F(
        "filesystem",
        "'filesystem': safetensors in weights/step_N, reloaded in place; 'nccl': the "
        "trainer broadcasts GPU to GPU into vLLM (backend vllm, separate GPUs, "
        "strict_async; see transport/nccl.py); 'ipc': trainer and vLLM share one GPU and the sidecar copies each "
        "policy from the trainer's buffer through a CUDA IPC handle (backend vllm, one sidecar, a one-process "
        "trainer, strict_async; see transport/ipc.py)",
        choices=("filesystem", "nccl", "ipc"),
    )
    reload: str = F(
        "direct",
        "nccl, ipc: how the sidecars' workers load a policy: 'direct' copies each tensor into vLLM's parameters in "
        "place (unquantized models; others fall back), 'layerwise': vLLM's reload lifecycle (inference/vllm_worker.py)",
        choices=("direct", "layerwise"),
    )
    nccl_host: str = F("127.0.0.1", "nccl: address of the trainer's rendezvous that the sidecars' workers join")
    nccl_port: int = F(
        0,
        "nccl: rendezvous port; 0 = `asyncrl rl` picks a free one (set it when you start the processes yourself)",
        ge=0,
        le=65535,
    )


@dataclass
class DifficultyConfig:
    enabled: bool = F(
        False, "drop groups too hard, too easy or too uniform before packing, counted as rollout/filtered_<reason>"
    )
    min_reward: float = F(0.05, "a group whose mean reward is below this is too hard")
    max_reward: float = F(0.95, "a group whose mean reward is above this is too easy")
    min_reward_variance: float = F(0.0, "a group whose reward variance is below this is too uniform", ge=0)
    skip_steps: int = F(
        0,
        "curriculum (on even when enabled=false): an example whose group scored above max_reward (solved) or below "
        "min_reward (hopeless) is not drawn again for this many steps (history kept in checkpoints); 0 = off",
        ge=0,
    )


@dataclass
class OrchestratorConfig:
    schedule: str = F(
        "step",
        "'step': each step draws its prompts and waits for all of them (replayable); 'continuous': groups stay "
        "in flight all the time and a batch is cut as soon as enough have finished (never waits for the slowest)",
        choices=("step", "continuous"),
    )
    prompts_per_step: int = F(8, "prompts per RL step (continuous: groups per batch, counted after filtering)", ge=1)
    group_size: int = F(8, "completions per prompt (the group of the advantage baseline)", ge=1)
    temperature: float = F(1.0, "sampling temperature (the trainer divides logits by it too)", gt=0)
    top_p: float = F(1.0, "nucleus sampling; <1 biases the importance ratio (logprobs are renormalised)", gt=0, le=1)
    max_tokens: int = F(64, "longest completion", ge=1)
    std_normalize: bool = F(False, "divide advantages by the group's reward std")
    drop_zero_advantage: bool = F(True, "drop groups whose rewards are all equal (no learning signal)")
    difficulty: DifficultyConfig = F(DifficultyConfig(), "online difficulty filtering (PRIME-RL's difficulty_filter)")
    max_inflight: int = F(
        0, "continuous: rollout groups kept in flight across all sidecars; 0 = 2 x prompts_per_step", ge=0
    )
    max_off_policy_steps: int = F(
        8,
        "continuous: a group with a token from a policy more than this many steps older than the batch it would "
        "join is dropped (rollout/stale_dropped); in-flight groups that can no longer make it are cancelled",
        ge=0,
    )
    max_concurrency: int = F(64, "requests in flight to the inference servers", ge=1)
    request_timeout_s: float = F(
        600.0, "HTTP timeout of one completion request (a server that exceeds it leaves rotation)", gt=0
    )
    health_check_s: float = F(
        10.0,
        "every this many seconds each server in rotation must answer /health within as long; one that misses "
        "3 in a row is hung and leaves rotation like a dead one (0 = no check)",
        ge=0,
    )
    request_retries: int = F(
        3, "further attempts of a request whose server failed (sent to another, or to it once it is back)", ge=0
    )
    reward_timeout_s: float = F(10.0, "a reward that takes longer scores 0 and is counted", gt=0)
    reward_workers: int = F(4, "threads scoring completions", ge=1)
    weights_poll_s: float = F(0.02, "how often to look for new weights", gt=0)
    wait_timeout_s: float = F(3600.0, "fail if the policy needed by a step does not appear in this time", gt=0)
    save_samples: bool = F(True, "write every step's samples to samples/step_N.jsonl")
    extra_body: Dict[str, Any] = F(
        {},
        "extra fields of every completion request (vLLM sampling extensions, "
        "e.g. {min_p: 0.05} or, for benchmarks, {ignore_eos: true})",
    )


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
    name: str = F("constant", "learning-rate schedule after warmup", choices=("constant", "linear", "cosine"))
    warmup_steps: int = F(0, "linear warmup steps", ge=0)
    min_lr_ratio: float = F(0.0, "final lr as a fraction of the peak (linear, cosine)", ge=0, le=1)


@dataclass
class LossConfig:
    type: str = F(
        "dppo_kl",
        "RL loss: PRIME-RL's default (DPPO mask + KL), PPO-clip (grpo), GSPO (sequence-level ratio and clip) or "
        "CISPO (clipped, stop-gradient IS weight on every token)",
        choices=("dppo_kl", "grpo", "gspo", "cispo"),
    )
    dppo_mask_low: float = F(0.2, "dppo_kl: mask tokens with A<0 whose prob dropped by more than this", ge=0)
    dppo_mask_high: float = F(0.2, "dppo_kl: mask tokens with A>0 whose prob rose by more than this", ge=0)
    adv_tau: float = F(1.0, "weight of the policy-gradient term", ge=0)
    kl_tau: float = F(1e-3, "weight of (log pi - log mu)^2 against the inference policy", ge=0)
    clip_low: float = F(0.2, "grpo: ratio clipped below at 1 - clip_low", ge=0, lt=1)
    clip_high: float = F(0.28, "grpo: ratio clipped above at 1 + clip_high", ge=0)
    gspo_clip_low: float = F(3e-4, "gspo: sequence ratio clipped below at 1 - this (the paper's 3e-4)", ge=0, lt=1)
    gspo_clip_high: float = F(4e-4, "gspo: sequence ratio clipped above at 1 + this (the paper's 4e-4)", ge=0)
    cispo_clip_high: float = F(
        0.28, "cispo: IS weight capped at 1 + this (no lower bound, as MiniMax-M1 runs it)", ge=0
    )


@dataclass
class KLConfig:
    beta: float = F(
        0.0,
        "weight of the KL penalty against the reference (the starting policy, a frozen copy in the trainer; "
        "k3 estimator per loss token); 0 = off, no reference kept",
        ge=0,
    )
    target_kl: float = F(
        0.0, "adapt beta after every step toward this KL (Ziegler et al. 2019's controller); 0 = beta stays fixed", ge=0
    )
    adapt_rate: float = F(
        0.1, "adaptive beta: beta *= 1 + adapt_rate * clip(kl_ref / target_kl - 1, -0.2, 0.2) each step", gt=0
    )


@dataclass
class DistillConfig:
    teacher: Optional[str] = F(
        None,
        "online distillation: the teacher (hub id or directory, the student's tokenizer), served by a sidecar of its "
        "own; null = off",
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
    num_threads: int = F(1, "torch CPU threads of the trainer; 0 = torch's default", ge=0)
    compile: bool = F(
        False,
        "torch.compile each decoder layer and the logprob head (fused norms, RoPE, SwiGLU and log-softmax; the "
        "first steps compile); not with numerics=reproducible or bitwise",
    )
    gpus: str = F(
        "", "CUDA_VISIBLE_DEVICES of the trainer in `asyncrl rl`, e.g. '1' or '0' (shares GPU 0); empty = inherit"
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
    keep_weights: int = F(4, "published weights/step_N kept on disk (those of checkpoints are kept too)", ge=1)
    wait_timeout_s: float = F(3600.0, "fail if the rollouts of a step do not appear in this time", gt=0)
    behavior_kl: bool = F(
        False,
        "also score each step's samples under the policy that sampled them and log train/behavior_kl: the "
        "train/inference mismatch without staleness (mismatch_kl includes the policy's change since sampling "
        "when async_level > 0). Costs a no-grad forward a step, a copy of the trainable weights (serving dtype) per "
        "async level, and a transient copy of them while it scores; schedule=step only",
    )


@dataclass
class SFTConfig:
    run_dir: str = F("${output_dir}/sft", "SFT run directory; the trained model is written to <run_dir>/model")
    max_steps: int = F(200, "optimizer steps", ge=1)
    batch_size: int = F(32, "examples per step", ge=1)
    optim: OptimConfig = F(OptimConfig(lr=1e-3), "optimizer")
    scheduler: SchedulerConfig = F(SchedulerConfig(), "learning-rate schedule")


@dataclass
class EvalConfig:
    out_dir: str = F("${output_dir}/eval", "where metrics.json and samples.jsonl go")
    split: str = F("eval", "dataset split to evaluate", choices=("eval", "train"))
    num_examples: int = F(0, "examples per environment; 0 = the whole split", ge=0)
    greedy: bool = F(True, "also score one greedy completion per prompt")
    n: int = F(4, "completions per prompt sampled at orchestrator.temperature (for mean reward and pass@k)", ge=1)
    pass_threshold: float = F(1.0, "a completion passes when its reward is at least this")
    url: Optional[str] = F(None, "evaluate against this server instead of starting a sidecar")


@dataclass
class CkptConfig:
    interval: int = F(0, "checkpoint every N steps; 0 = only at the end", ge=0)
    keep_last: int = F(2, "checkpoints kept on disk", ge=1)
    resume: str = F("none", "'none', 'latest' or a step number: resume the run in run_dir from that checkpoint")


@dataclass
class LogExtrasConfig:
    interval: int = F(10, "log the extras at steps 0, interval, 2 * interval, ...", ge=1)
    samples: bool = F(
        True, "orchestrator: a table of rollouts (prompt, completion, reward, advantage, policy version, environment)"
    )
    max_samples: int = F(16, "rows of the samples table per logged step (spread over the step's groups)", ge=1)
    distributions: bool = F(
        True,
        "histograms: reward, advantage, completion length, staleness (orchestrator); entropy and importance "
        "ratio of the loss tokens (trainer)",
    )


@dataclass
class WandbConfig:
    enabled: bool = F(False, "log to Weights & Biases as well as JSONL")
    project: str = F("asyncrl", "W&B project")
    entity: Optional[str] = F(None, "W&B entity")
    mode: str = F("auto", "'auto' = online with WANDB_API_KEY, offline without", choices=("auto", "online", "offline"))
    log_extras: LogExtrasConfig = F(LogExtrasConfig(), "W&B tables and histograms besides the scalars")


@dataclass
class MonitorConfig:
    wandb: WandbConfig = F(WandbConfig(), "Weights & Biases")


@dataclass
class LauncherConfig:
    progress: bool = F(True, "show a live progress line")
    overwrite: bool = F(False, "replace a finished or failed run already in run_dir (default: refuse)")
    shutdown_timeout_s: float = F(10.0, "grace period before stopped processes are killed", gt=0)
    poll_s: float = F(0.2, "how often the launcher checks its processes", gt=0)
    max_restarts: int = F(
        3,
        "times `asyncrl rl` restarts a sidecar that died (on its port; the orchestrator waits for it and brings "
        "it to the current policy); 0 = a dead sidecar stops the run",
        ge=0,
    )
