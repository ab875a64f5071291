"""Config of the inference sidecar (built-in or vLLM) and how new weights reach it.

Torch-free: the CLI imports it to print ``--help``.

Each field is typed, documented in its ``F(doc=...)`` and bounded where it can be; YAML files in ``conf/``
only choose and override values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from asyncrl.config.fields import F


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
        "(asyncrl's vLLM plugin: the engine core keeps each step's arrays whole, the frontend reads a "
        "request's rows in bulk; the same numbers; `python benchmarks/rollouts.py --defer-logprobs 0 1` "
        "compares the throughput; asyncrl/inference/vllm/logprobs.py)",
    )
    logprobs_kernel: bool = F(
        True,
        "compute a decode step's sampled-token logprobs (requests asking logprobs=0) by one asyncrl kernel "
        "into one array copied to the host once, instead of vLLM's two kernels and three copies (asyncrl's "
        "vLLM plugin; vLLM's numbers to the bit; dense models on vLLM 0.26 only: another vLLM refuses to "
        "start with it on; `python benchmarks/rollouts.py --logprobs-kernel 0 1` compares the throughput; "
        "asyncrl/inference/vllm/sampled.py)",
    )
    log_stats: bool = F(
        False,
        "vLLM's per-step statistics (its periodic throughput log line, Prometheus /metrics): off, since the "
        "frontend spends ~20% of its busy time on them per token (py-spy: `bash benchmarks/gpu_logprobs.sh "
        "sidecar`); turn on to monitor the server",
    )
    extra_args: List[str] = F(
        [],
        "further vLLM CLI flags, verbatim (e.g. ['--kv-cache-dtype', 'fp8']; tensor parallelism is "
        "inference.tensor_parallel)",
    )


@dataclass
class InferenceConfig:
    backend: str = F(
        "hf", "inference backend: 'hf' (built-in, CPU or GPU) or 'vllm' (GPU)", choices=("hf", "vllm")
    )
    gpus: List[str] = F(
        [],
        "one entry per sidecar (inference replica): its CUDA_VISIBLE_DEVICES, naming "
        "inference.tensor_parallel GPUs, e.g. ['0'], ['0', '1'] (two replicas) or ['0,1'] (one replica on "
        "two GPUs with tensor_parallel=2); empty = one sidecar with the default devices (conf/layout/ holds "
        "the usual layouts; config/layout.py checks them)",
    )
    tensor_parallel: int = F(
        1,
        "GPUs per sidecar, vLLM's tensor parallelism (--tensor-parallel-size); "
        "every worker joins the nccl group",
        ge=1,
    )
    share_gpus: bool = F(
        False,
        "let processes share a GPU on purpose (a trainer on a sidecar's GPU, two replicas on one): without "
        "it a GPU named twice in inference.gpus, trainer.fabric.gpus and distill.gpus is a config error; "
        "lower inference.vllm.gpu_memory_utilization so both fit",
    )
    host: str = F(
        "127.0.0.1", "address the sidecar binds to (admin routes accept only loopback without a token)"
    )
    port: int = F(
        0,
        "sidecar port; 0 = a free one, chosen at launch (the run's config records it in inference.urls)",
        ge=0,
        le=65535,
    )
    urls: List[str] = F([], "use these running servers (base URLs) instead of starting a sidecar")
    admin_token: Optional[str] = F(
        None,
        "bearer token that lets non-loopback clients call admin routes (kept in <run_dir>/configs/, made "
        "0700; <redacted> in the overrides and run_meta.json)",
    )
    max_batch_size: int = F(
        256, "most sequences decoded together (a larger request is decoded in parts)", ge=1
    )
    max_request_rows: int = F(
        4096, "most sequences one request may ask for (prompts x n); more get a 400", ge=1
    )
    max_body_mb: float = F(
        16.0, "largest request body in MiB; a larger one gets a 413 before it is read", gt=0
    )
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
class NCCLConfig:
    """The trainer's NCCL rendezvous, which every sidecar's workers join (``weights.transport=nccl``)."""

    host: str = F("127.0.0.1", "address of the trainer's rendezvous that the sidecars' workers join")
    port: int = F(
        0,
        "rendezvous port; 0 = `asyncrl rl` picks a free one (set it when you start the processes yourself)",
        ge=0,
        le=65535,
    )


@dataclass
class WeightsConfig:
    """How each new policy travels from the trainer to the sidecars (see transport/)."""

    transport: str = F(
        "filesystem",
        "'filesystem': safetensors in weights/step_N, reloaded in place; 'nccl': the trainer broadcasts GPU "
        "to GPU into vLLM (backend vllm, separate GPUs, strict_async; see transport/nccl.py); 'ipc': "
        "trainer and vLLM share one GPU and the sidecar copies each policy from the trainer's buffer "
        "through a CUDA IPC handle (backend vllm, one sidecar, a one-process trainer, strict_async; see "
        "transport/ipc.py); or your own, 'package.module:Class' (a subclass of "
        "asyncrl.transport.base.Transport; docs/extending.md)",
    )
    reload: str = F(
        "direct",
        "nccl, ipc: how the sidecars' workers load a policy: 'direct' copies each tensor into vLLM's "
        "parameters in place (unquantized models; others fall back), 'layerwise': vLLM's reload "
        "lifecycle (inference/vllm/worker.py)",
        choices=("direct", "layerwise"),
    )
    nccl: NCCLConfig = F(NCCLConfig(), "weights.transport=nccl's rendezvous (transport/nccl.py)")
    args: Dict[str, Any] = F(
        {},
        "your own transport's settings (one that takes_args; its config_errors checks them); the "
        "built-ins take none",
    )
