"""The numerics switch: the environment it sets, what it gives back, the config rules, and the ops that the
reproducible CPU paths may call (the cross-machine runs are in tests/integration/test_golden.py)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl import numerics
from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config


def test_reproducible_pins_kernels_threads_and_remembers_the_users_values():
    env = {"MKL_CBWR": "AVX512", "MKL_ENABLE_INSTRUCTIONS": "AVX512", "OMP_NUM_THREADS": "16", "HOME": "/h"}
    numerics.apply("reproducible", 2, env)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "COMPATIBLE"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2" and env["MKL_DYNAMIC"] == "FALSE"
    assert "MKL_ENABLE_INSTRUCTIONS" not in env and env[numerics.MARKER] == "reproducible"
    # a nested reproducible process keeps the first parent's record of the user's values
    numerics.apply("reproducible", 1, env)
    assert env["OMP_NUM_THREADS"] == "1"
    # fast, started by a reproducible parent, gets the user's environment back
    numerics.apply("fast", 0, env)
    assert (
        env["MKL_CBWR"] == "AVX512"
        and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX512"
        and env["OMP_NUM_THREADS"] == "16"
    )
    assert "ATEN_CPU_CAPABILITY" not in env and numerics.OUTER not in env and env["HOME"] == "/h"


def test_fast_without_a_reproducible_parent_changes_only_threads():
    env = {"ATEN_CPU_CAPABILITY": "default"}
    numerics.apply("fast", 0, env)
    assert env == {"ATEN_CPU_CAPABILITY": "default", numerics.MARKER: "fast"}
    numerics.apply("fast", 3, env)
    assert env["OMP_NUM_THREADS"] == "3" and env["ATEN_CPU_CAPABILITY"] == "default"


def test_bad_modes_and_thread_counts_are_refused():
    with pytest.raises(ValueError, match="numerics='exact' is not allowed"):
        numerics.apply("exact", 1, {})
    with pytest.raises(ValueError, match="fixed thread count"):
        numerics.apply("reproducible", 0, {})


def test_applying_after_torch_is_imported_fails_loudly():
    # this process imported torch under reproducible settings (tests/conftest.py): switching is refused,
    # and nothing was changed
    before = dict(numerics.os.environ)
    with pytest.raises(RuntimeError, match="before torch is imported"):
        numerics.apply("fast", 1)
    assert dict(numerics.os.environ) == before
    numerics.apply("reproducible", 1)  # the settings already in force: fine


def test_deterministic_algorithms_reach_aten_and_inductor_without_loading_inductor():
    """What torch.use_deterministic_algorithms(True) sets (ATen's flag and Inductor's), with Inductor loaded
    only when something compiles: a fresh process, as a sidecar or engine starts."""
    script = (
        "import sys, torch; from asyncrl import numerics; numerics.configure_torch('reproducible', 1); "
        "print(torch.are_deterministic_algorithms_enabled(), 'torch._inductor.config' in sys.modules); "
        "import torch._inductor.config as c; print(c.deterministic)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "True"]


def test_config_resolves_the_mode_and_rejects_what_cannot_hold():
    assert compose_config([]).numerics == "reproducible"
    assert (
        compose_config(["trainer.fabric.accelerator=cuda", "trainer.fabric.num_threads=0"]).numerics
        == "fast"
    )
    assert compose_config(["numerics=fast", "inference.num_threads=4"]).numerics == "fast"
    assert compose_config(["numerics=fast", "trainer.fabric.compile=true"]).trainer.fabric.compile
    for overrides, key in (
        (["numerics=exact"], "numerics='exact' is not allowed"),
        (["numerics=bitwise"], "trainer.fabric.accelerator='cpu'"),
        (["numerics=bitwise"], "inference.backend='hf' must be 'vllm'"),
        (
            ["numerics=bitwise", "orchestrator.top_p=0.9", "trainer.loss.truncated_logprobs=false"],
            "would score the",
        ),
        (["+orchestrator.extra_body.min_p=0.05"], "extra_body sets min_p: set orchestrator.min_p instead"),
        (["+orchestrator.extra_body.top_k=5"], "extra_body sets top_k: set orchestrator.top_k instead"),
        (["numerics=bitwise", "+orchestrator.extra_body.repetition_penalty=1.1"], "sets repetition_penalty"),
        (["numerics=bitwise", "model.lora.enabled=true"], "LoRA"),
        (["numerics=bitwise", "trainer.fabric.accelerator=auto"], "trainer.fabric.accelerator='auto'"),
        (
            ["numerics=bitwise", "inference.vllm.extra_args=[--tensor-parallel-size,2]"],
            "sets --tensor-parallel-size",
        ),
        (["numerics=bitwise", "inference.vllm.extra_args=[-O3]"], "extra_args sets -O3"),
        (
            ["trainer.behavior_kl=true", "orchestrator.schedule=continuous"],
            "needs orchestrator.schedule=step",
        ),
        (["numerics=reproducible", "trainer.fabric.accelerator=cuda"], "trainer.fabric.accelerator=cuda"),
        (["numerics=reproducible", "inference.gpus=[0]"], r"inference.gpus=\['0'\]"),
        (["trainer.fabric.num_threads=0"], "trainer.fabric.num_threads=0"),
        (["inference.num_threads=2"], "inference.num_threads=2"),
        (["trainer.fabric.compile=true"], "trainer.fabric.compile=true: Inductor's CPU code"),
        (
            ["numerics=bitwise", "trainer.fabric.compile=true"],
            "numerics=bitwise with trainer.fabric.compile=true",
        ),
    ):
        with pytest.raises(ConfigError, match=key):
            compose_config(overrides)


def test_bitwise_mode_is_fast_plus_vllms_batch_invariant_flag():
    ok = ["numerics=bitwise", "inference.backend=vllm", "trainer.fabric.accelerator=cuda", "model=hf",
          "model.name=Qwen/Qwen3-0.6B"]  # fmt: skip
    assert compose_config(ok).numerics == "bitwise"
    # the trainer scores the truncated distribution the sampler draws from, so bitwise holds under truncation
    # too
    truncated = ["orchestrator.top_p=0.9", "orchestrator.top_k=20", "orchestrator.min_p=0.05"]
    assert compose_config([*ok, *truncated]).numerics == "bitwise"
    env = {"ATEN_CPU_CAPABILITY": "default"}
    numerics.apply("bitwise", 2, env)
    assert env["VLLM_BATCH_INVARIANT"] == "1" and env["ATEN_CPU_CAPABILITY"] == "default"
    numerics.apply("fast", 2, env)  # started by a bitwise process: vLLM's default kernels again
    assert "VLLM_BATCH_INVARIANT" not in env and env[numerics.MARKER] == "fast"
    meta = numerics.describe("bitwise", {"trainer": 1, "inference": 0})
    assert meta["env"]["inference"] == {"VLLM_BATCH_INVARIANT": "1"}


def test_describe_names_the_cpu_threads_and_variables():
    meta = numerics.describe("reproducible", {"trainer": 2, "inference": 1})
    assert meta["mode"] == "reproducible" and meta["threads"] == {"trainer": 2, "inference": 1}
    assert (
        meta["env"]["trainer"]["OMP_NUM_THREADS"] == "2"
        and meta["env"]["inference"]["MKL_CBWR"] == "COMPATIBLE"
    )
    assert meta["cpu"]["model"] and "avx2" in meta["cpu"]["flags"]


class _Ops(TorchDispatchMode):
    """Every aten op called while active (overload packets, e.g. ``aten.sqrt``)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[
            str(func.overloadpacket).split(".", 1)[-1].lstrip("_").removeprefix("foreach_").rstrip("_")
        ] += 1
        return func(*args, **(kwargs or {}))


def _trainer_step(micro_model, fused: bool) -> Counter:
    from asyncrl.config.model import ModelConfig
    from asyncrl.config.trainer import LossConfig, OptimConfig
    from asyncrl.models.hf import load_model
    from asyncrl.trainer.forward import packed_logprobs
    from asyncrl.trainer.loss import LossInputs, rl_loss, sft_loss
    from asyncrl.trainer.optim import build_optimizer, clip_gradients

    model = load_model(ModelConfig(name=str(micro_model)), dtype="float32").train()
    optimizer = build_optimizer(model, OptimConfig(), fused=fused)
    g = torch.Generator().manual_seed(0)
    rows, length = 4, 32
    mb = {
        "input_ids": torch.randint(6, 30, (rows, length), generator=g),
        "temperatures": torch.ones(rows, length),
        "position_ids": torch.arange(length).repeat(rows, 1),
    }
    shifted = (rows, length - 1)
    census = _Ops()
    with census:
        logprobs = packed_logprobs(model, mb)
        loss, _ = rl_loss(
            LossInputs(
                logprobs,
                logprobs.detach() - 0.01,
                torch.randn(shifted, generator=g),
                torch.ones(shifted, dtype=torch.bool),
                total_tokens=rows * length,
            ),
            LossConfig(),
        )
        loss = loss + sft_loss(logprobs, torch.ones(shifted, dtype=torch.bool), rows * length)
        loss.backward()
        clip_gradients(list(model.parameters()), 1.0)
        optimizer.step()
    return census.seen


def test_reproducible_cpu_paths_avoid_vendor_dependent_ops(micro_model):
    from asyncrl.config.inference import InferenceConfig
    from asyncrl.config.model import ModelConfig
    from asyncrl.inference.builtin.engine import GenRequest, HFEngine
    from asyncrl.models.hf import render_prompt

    trainer_ops = _trainer_step(micro_model, fused=numerics.use_fused_adamw("reproducible", "cpu"))
    engine = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    prompt = render_prompt(engine.tokenizer, [{"role": "user", "content": "abc"}])
    sidecar = _Ops()
    # add() and step() run in inference mode, where composite ops (linear, sdpa) reach the census
    # undecomposed: under no_grad they are seen down to the kernels that run
    with torch.no_grad(), sidecar:
        HFEngine.add.__wrapped__(
            engine,
            [
                GenRequest(prompt, n=3, max_tokens=6, temperature=0.7, top_p=0.9, seed=1, top_logprobs=2),
                GenRequest(prompt, n=1, max_tokens=6, temperature=0.0),
            ],
        )
        while engine.busy:
            HFEngine.step.__wrapped__(engine)
    for name, ops in (("trainer", trainer_ops), ("sidecar", sidecar.seen)):
        assert ops["mm"] + ops["addmm"] + ops["bmm"] > 0, (
            f"the {name} census saw no matrix products: it is broken"
        )
        bad = sorted(set(ops) & set(numerics.VML_AVOID))
        assert not bad, (
            f"the {name}'s CPU path calls {bad}, whose MKL VML results differ between CPU vendors"
        )


def test_the_census_sees_the_sqrt_of_unfused_adamw(micro_model):
    # why the trainer uses the fused AdamW on CPU: the default implementation takes torch.sqrt
    assert "sqrt" in _trainer_step(micro_model, fused=False)


def test_python_means_do_not_depend_on_order_or_python_version():
    # the sum() of floats changed in Python 3.12 (compensated); means in advantages and metrics use
    # math.fsum, the correctly rounded sum, so these come out the same on 3.11 and 3.12 and in any order
    from asyncrl.orchestrator.advantages import compute_advantages
    from asyncrl.rollouts.metrics import mean

    rewards = [1e16, 1.0, -1e16, 1.0]
    assert mean(rewards) == mean(rewards[::-1]) == 0.5  # a plain left-to-right sum gives 0.25
    assert compute_advantages(rewards)[1] == 0.5
