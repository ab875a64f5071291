"""The numerics switch, ``numerics=reproducible|fast|bitwise``: which kernels every process may use.

``reproducible`` promises the same bits on every x86-64 CPU with AVX2, whatever its vendor, its newer
ISA extensions (AVX-512, AMX) or its core count. Three libraries pick kernels by CPU at run time, and
each is pinned here, through environment variables that must be set *before torch is imported*:

- **ATen** (torch's own kernels: softmax, norms, sampling, RNG, optimizers) dispatches to a build for
  the best ISA it finds: ``ATEN_CPU_CAPABILITY=avx2`` makes every machine run the AVX2 build. The AVX2
  and AVX-512 builds differ (vector width changes reduction order; ``normal_`` has an AVX2-only path).
- **MKL** (matrix products and the VML functions behind ``exp``, ``log``, ``tanh``...) picks per CPU
  model and vendor. Its CNR branches ``AVX2``/``AVX512`` apply to Intel CPUs only ("On non-Intel CPUs
  ... the AUTO branch is used instead", oneMKL developer guide, Getting Started with CNR), and they
  differ between an Intel Xeon and an AMD EPYC. ``MKL_CBWR=COMPATIBLE`` is the one branch documented for
  Intel *and* compatible CPUs; on an AMD EPYC (Zen 3, AVX2) and an Intel Xeon (Sapphire Rapids, AVX-512
  + AMX) its GEMMs (every shape, every row count, 1 and 8 threads) and VML functions agree bit for bit,
  except ``sqrt``, which no asyncrl CPU path calls (AdamW runs fused on CPU for that reason, see
  :func:`use_fused_adamw`). ``python benchmarks/vml_agreement.py --threads 1`` on two machines compares them.
- **oneDNN** is capped at AVX2 with strict fp32 math (asyncrl's fp32 paths do not reach it today;
  the cap keeps a future op from bringing AMX or bf16 in silently).

Threads: a parallel reduction's result depends on how many threads split it, and MKL's CNR holds for
a fixed count only, so the count comes from the config (``trainer.fabric.num_threads``,
``inference.num_threads``), never from the machine: a 16-core host hashes like a 2-core one.
The sidecar needs exactly 1 thread: with 2, MKL splits a batch's rows between threads differently for
each batch size, so a request's logprobs would depend on what shares its batch.

End to end, the golden pipeline of tests/helpers/golden.py (prepare, SFT, RL with sidecar and trainer, eval)
gives the same model, metric and eval hashes on an AMD EPYC (Zen 3, 2 cores; torch 2.13, Python 3.11) and an
Intel Xeon (Sapphire Rapids, 16 cores; torch 2.11, Python 3.12): ``pytest tests/integration/test_golden.py``
on each checks them against tests/golden.json. Two more pins make that hold: the hf sidecar stays on the CPU
when the machine has a GPU, and Python-level means use ``math.fsum`` (Python 3.12's ``sum()`` of floats
rounds differently from 3.11's).

``fast`` leaves every library to pick the machine's best kernels and thread count; a process started
with ``fast`` by a ``reproducible`` parent gets the user's own variables back.

``bitwise`` (GPU, vLLM sidecar) is ``fast`` plus train = inference bit for bit: vLLM runs batch-invariant
(``VLLM_BATCH_INVARIANT=1``, set here for every process) on its eager kernels with Triton attention
(:func:`asyncrl.inference.vllm.server.vllm_cli_args`) and asyncrl's plugin for its residual RMSNorm
(:mod:`asyncrl.inference.vllm.plugin`, which reads this module's marker), and the RL trainer's forward is
built from the same kernels (:mod:`asyncrl.models.bitwise`), so the trainer's logprobs of a sample under the
policy that sampled it are the sidecar's, and ``mismatch_kl`` is exactly 0. The SFT trainer and the RL
trainer's reference and teacher forwards keep the default kernels; a vLLM server started in this mode
(eval's, a teacher's) runs batch-invariant like the policy's sidecar.

One module applies it in every process: :func:`apply` (env, before torch) from ``asyncrl.cli`` and
the test suite's conftest, :func:`configure_torch` (threads, deterministic algorithms) once torch is
imported. :func:`describe` is what ``run_meta.json`` records.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import MutableMapping
from typing import Any

from asyncrl.config.root import MODES

BITWISE_ENV = {"VLLM_BATCH_INVARIANT": "1"}  # read by vLLM at import, in the sidecar and in the trainer
MARKER = "ASYNCRL_NUMERICS"  # the mode this process (and what it starts) runs in
OUTER = "ASYNCRL_NUMERICS_OUTER"  # JSON: the user's values of the variables that reproducible mode replaced
# read once, when torch loads its kernels: changing them after `import torch` would be silently ignored
READ_AT_IMPORT = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
)


# torch computes these ops on CPU through MKL's VML. In the COMPATIBLE branch, float32 and float64, exp, log,
# tanh, sin, cos, expm1, log1p, log2, erf and atan agree bit for bit between an Intel Xeon and an AMD EPYC;
# sqrt does not (neither machine rounds it correctly), and the rest of this list is not known to agree
# (`python benchmarks/vml_agreement.py` on two machines compares them all). A CPU path under
# numerics=reproducible must not call them (tests/unit/test_numerics.py checks the trainer's and the
# sidecar's paths op by op).
VML_AVOID = ("sqrt", "acos", "asin", "erfc", "erfinv", "log10", "tan")


def reproducible_env(threads: int) -> dict[str, str | None]:
    """The variables ``reproducible`` sets for a process with ``threads`` torch threads (``None`` =
    unset)."""
    n = str(threads)
    return {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "COMPATIBLE",
        "MKL_ENABLE_INSTRUCTIONS": None,  # would narrow MKL's dispatch per machine; the CBWR branch decides
        "MKL_DEBUG_CPU_TYPE": None,  # an old override of MKL's vendor check
        "MKL_DYNAMIC": "FALSE",  # CNR holds only if MKL never lowers the thread count on its own
        "OMP_DYNAMIC": "FALSE",
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "MKL_DOMAIN_NUM_THREADS": None,
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "DNNL_MAX_CPU_ISA": "AVX2",  # oneDNN's older name of the same cap
        "ONEDNN_DEFAULT_FPMATH_MODE": "STRICT",  # no implicit bf16/tf32 in fp32 primitives
    }


def checked(mode: str | None) -> str:
    """``mode`` if it is one of :data:`MODES`; the config leaves it ``None`` (automatic) until
    ``check_config`` resolves it, so ``None`` here means an unchecked config reached a process."""
    if mode is None or mode not in MODES:
        raise ValueError(f"numerics={mode!r} is not allowed; allowed values: {', '.join(map(repr, MODES))}")
    return mode


def process_threads(cfg, command: str) -> int:
    """Torch threads of the process that runs ``asyncrl <command>``: the sidecar's and the trainers' come
    from the config; the others (launcher, orchestrator, prepare, eval's client) run torch on one thread, if
    at all."""
    if command == "serve":
        return cfg.inference.num_threads
    if command in ("train", "sft"):
        return cfg.trainer.fabric.num_threads
    return 1


def run_threads(cfg) -> dict[str, int]:
    """Thread count of every kind of process, for :func:`describe`."""
    return {"trainer": cfg.trainer.fabric.num_threads, "inference": cfg.inference.num_threads, "other": 1}


def outer_environ(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` as the user set it: what a reproducible parent replaced is given back."""
    env = dict(os.environ if environ is None else environ)
    for key, value in json.loads(env.pop(OUTER, "") or "{}").items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.pop(MARKER, None)
    return env


def apply(
    mode: str | None, threads: int, environ: MutableMapping[str, str] | None = None
) -> dict[str, str | None]:
    """Set the environment of ``mode`` for this process and the processes it starts; returns what was set.

    Call before ``import torch``. Raises ``RuntimeError`` if torch is already imported under different
    kernel settings, which would otherwise be ignored without a word.
    """
    env = os.environ if environ is None else environ
    mode = checked(mode)
    outer = json.loads(env.get(OUTER) or "null")
    if mode == "reproducible":
        if threads < 1:
            raise ValueError(f"numerics=reproducible needs a fixed thread count >= 1, got {threads}")
        wanted = reproducible_env(threads)
        # the first parent's view wins
        outer = outer if outer is not None else {k: env.get(k) for k in wanted}
    else:
        wanted = dict(outer or {})  # give back the user's variables (no-op without a reproducible parent)
        if threads > 0:
            wanted.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if mode == "bitwise":
            wanted.update(BITWISE_ENV)
        elif env.get(MARKER) == "bitwise":  # a fast process started by a bitwise one: vLLM's default kernels
            wanted.update(dict.fromkeys(BITWISE_ENV))
    late = [k for k in READ_AT_IMPORT if k in wanted and env.get(k) != wanted[k]]
    if late and environ is None and "torch" in sys.modules:
        raise RuntimeError(
            f"numerics={mode} must be applied before torch is imported (would change {', '.join(late)}); "
            "run the command in its own process"
        )
    for key, value in wanted.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env[MARKER] = mode
    if mode == "reproducible":
        env[OUTER] = json.dumps(outer, sort_keys=True)
    else:
        env.pop(OUTER, None)
    return wanted


def configure_torch(mode: str | None, threads: int) -> None:
    """Once torch is imported: the thread count, and in ``reproducible`` mode deterministic algorithms,
    full-precision fp32 matmuls and a check that the pinned AVX2 kernels are really in use."""
    import torch  # lazy: this module stays torch-free, apply() must run before torch loads

    if threads > 0:
        torch.set_num_threads(threads)
    if checked(mode) != "reproducible":
        return
    use_deterministic_algorithms()
    torch.set_float32_matmul_precision("highest")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        raise RuntimeError(
            f"numerics=reproducible runs torch's AVX2 kernels, but this process uses {capability}: "
            f"this CPU lacks AVX2 ({cpu_info()['model']}), or torch was imported before "
            "asyncrl.numerics.apply; use numerics=fast here"
        )


def use_deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True)`` without importing Inductor at start-up: torch's function
    sets the flag in ATen and ``torch._inductor.config.deterministic``, and the import of that config module
    loads Dynamo and Inductor (about 2 s of every sidecar's and engine's start-up on 2 CPU cores, where
    nothing compiles). The flag goes to ATen now and to Inductor through the variable its config reads when
    it loads, so a process that compiles later (or has Inductor loaded already) gets what torch's function
    sets. ``python -X importtime -c "import torch; torch.use_deterministic_algorithms(True)"`` shows the
    import."""
    import torch  # lazy: this module stays torch-free: apply() runs before torch is imported

    torch._C._set_deterministic_algorithms(True, warn_only=False)
    inductor: Any = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = True
    else:
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"


def use_fused_adamw(mode: str | None, accelerator: str) -> bool:
    """AdamW's fused CPU kernel takes IEEE square roots; the default path calls ``torch.sqrt``, which on CPU
    is MKL VML's ``vsSqrt``: not correctly rounded (~15% of float32 results) and different on Intel and AMD
    even in MKL's COMPATIBLE branch (``python benchmarks/vml_agreement.py`` prints both). On GPU the default
    stays."""
    return checked(mode) == "reproducible" and accelerator == "cpu"


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name, vendor and ISA flags (first processor of ``/proc/cpuinfo``; empty off Linux)."""
    info: dict[str, Any] = {"model": None, "vendor": None, "flags": []}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and info["model"] is None:
                    info["model"] = value.strip()
                elif key == "vendor_id" and info["vendor"] is None:
                    info["vendor"] = value.strip()
                elif key == "flags":
                    info["flags"] = value.split()
                    break
    except OSError:
        pass
    return info


def describe(mode: str | None, threads: dict[str, int]) -> dict:
    """What ``run_meta.json`` records: the mode, the CPU, each process's thread count and the variables
    set."""
    cpu = cpu_info()
    env = {
        name: (
            reproducible_env(n)
            if mode == "reproducible"
            else ({"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)} if n > 0 else {})
            | (BITWISE_ENV if mode == "bitwise" else {})
        )
        for name, n in threads.items()
    }
    isa = [
        f
        for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
        if f in cpu["flags"]
    ]
    return {
        "mode": mode,
        "cpu": {**cpu, "isa": isa},
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "env": env,
        "outer_env": json.loads(os.environ.get(OUTER) or "null"),
    }
