"""LoRA end to end on CPU (model.lora): the trainer trains adapters only, publishes them in peft's layout,
the built-in sidecar merges them on load (its logprobs equal the trainer's at every on-policy step),
checkpoints hold adapters and optimizer, and the final model is base + adapter merged."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from helpers.launch import asyncrl, rl_args
from helpers.metrics import read_jsonl

LORA = ["model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16"]


def test_lora_rl_hands_off_adapters_that_the_sidecar_merges(setup, tmp_path):
    run = tmp_path / "rl"
    args = [a for a in rl_args(setup, run) if not a.startswith("orchestrator.prompts_per_step=")]
    # async_level=0: every step samples from the policy the trainer holds, so any train/inference gap is the
    # hand-off's (an adapter merged wrongly, or not loaded, shows at step 1 on)
    on_policy = [
        "orchestrator.prompts_per_step=8",
        "async_level=0",
        "trainer.optim.lr=1e-2",
        "ckpt.interval=3",
    ]
    on_policy.append("trainer.kl.beta=0.1")  # a LoRA run's reference: the same model, adapters switched off
    proc = asyncrl("rl", *args, *LORA, *on_policy, "max_steps=3")
    assert proc.returncode == 0, proc.stderr
    train = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in train] == [0, 1, 2]
    assert all(r["train/grad_norm"] > 0 for r in train), train
    assert train[0]["train/kl_ref"] == 0 and all(r["train/kl_ref"] > 0 for r in train[1:]), train
    assert all(abs(r["train/mismatch_kl"]) < 1e-7 for r in train), [r["train/mismatch_kl"] for r in train]
    # the hand-off is an adapter, in peft's layout, with B no longer zero
    step = run / "weights" / "step_3"
    cfg = json.loads((step / "adapter_config.json").read_text())
    assert (
        cfg["r"] == 8
        and cfg["lora_alpha"] == 16
        and sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    )
    adapter = load_file(str(step / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapter.items())
    assert not (step / "model.safetensors").exists()
    # the checkpoint holds the adapters (and optimizer), not the frozen base
    ckpt = torch.load(run / "checkpoints" / "step_3" / "trainer" / "state.ckpt", weights_only=False)
    assert ckpt["model"] and all(".lora_" in k for k in ckpt["model"]), list(ckpt["model"])[:3]
    # the final model is base + (alpha / r) * B @ A on the adapted layers, the base everywhere else
    base = load_file(str(setup["sft_model"] / "model.safetensors"))
    final = load_file(str(run / "model" / "model.safetensors"))
    a = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(final[q], base[q] + 2.0 * b @ a, rtol=1e-5, atol=1e-6)
    mlp = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(final[mlp], base[mlp])
    assert (run / "adapter" / "adapter_config.json").exists()


def test_lora_sft_resumes_from_adapter_checkpoints_and_exports_merged(setup, tmp_path):
    """SFT with LoRA: a run resumed from its adapter-only checkpoint ends with the same adapter, bit for bit,
    as a straight run (the optimizer state came back too); the SFT model it writes is base + adapter."""
    base = [
        *setup["common"],
        f"model.name={setup['base_model']}",
        *LORA,
        "sft.optim.lr=1e-2",
        "ckpt.interval=2",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    asyncrl("sft", *base, f"sft.run_dir={straight}", "sft.max_steps=4", check=True)
    asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=2", check=True)
    asyncrl("sft", *base, f"sft.run_dir={resumed}", "sft.max_steps=4", "ckpt.resume=latest", check=True)
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = torch.load(resumed / "checkpoints" / "step_2" / "trainer" / "state.ckpt", weights_only=False)
    assert all(".lora_" in k for k in ckpt["model"]) and ckpt["optimizer"]["state"]
    losses = [r["sft/loss"] for r in read_jsonl(straight / "metrics" / "sft.jsonl")]
    assert losses[-1] < losses[0], losses
    merged, start = (
        load_file(str(p / "model.safetensors")) for p in (straight / "model", setup["base_model"])
    )
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], start[q]) and merged.keys() == start.keys()
