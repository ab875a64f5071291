"""LoRA pieces on the micro model: merge-on-load equals peft's own merge and never accumulates, bad adapters
are refused with a reason (before anything changes), vLLM's flags, config checks, `asyncrl merge-lora`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import LoRAConfig, ModelConfig
from asyncrl.inference.builtin.engine import HFEngine
from asyncrl.models.adapters import merged_weight, vllm_max_rank
from asyncrl.models.lora import apply_lora
from helpers.launch import asyncrl


def adapter(micro_model, out, seed, r=4, alpha=8):
    """A trained-looking adapter for the micro model (random A and B), saved in peft's layout."""
    from asyncrl.models.hf import load_model

    torch.manual_seed(seed)
    model = apply_lora(
        load_model(ModelConfig(name=str(micro_model))), LoRAConfig(enabled=True, r=r, alpha=alpha)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    return model


def test_merged_weight_is_w0_plus_scaled_b_a():
    w0, a, b = torch.ones(3, 2), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [-1.0]])
    assert merged_weight(w0, a, b, 0.5).tolist() == [[1.5, 2.0], [1.0, 1.0], [0.5, 0.0]]


def test_merge_on_load_equals_peft_and_does_not_accumulate(micro_model, tmp_path):
    eng = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    base = {k: v.clone() for k, v in eng.model.state_dict().items()}
    for seed in (1, 2):  # the second adapter replaces the first: base + adapter 2, not base + 1 + 2
        peft_model = adapter(micro_model, tmp_path / f"a{seed}", seed)
        eng.load_weights(tmp_path / f"a{seed}", seed)
        expected = peft_model.merge_and_unload().state_dict()
        got = eng.model.state_dict()
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6)
        assert eng.version == seed
    assert not torch.equal(
        eng.model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
        base["model.layers.0.self_attn.q_proj.weight"],
    )
    assert torch.equal(
        eng.model.state_dict()["model.layers.0.mlp.up_proj.weight"],
        base["model.layers.0.mlp.up_proj.weight"],
    )
    # full weights again: the base is back and the next adapter merges onto it
    eng.load_weights(micro_model, 3)
    assert all(torch.equal(eng.model.state_dict()[k], v) for k, v in base.items())
    assert not eng.lora.base


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("shape", "do not fit"),
        ("drop_b", "needs lora_A and lora_B"),
        ("rename", "no such weight"),
        ("config", "not readable JSON"),
        ("dora", "not supported"),
        ("truncate", "not a readable safetensors"),
    ],
)
def test_a_bad_adapter_is_refused_and_changes_nothing(micro_model, tmp_path, damage, reason):
    eng = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    path = tmp_path / "a"
    adapter(micro_model, path, 1)
    weights, cfg_file = path / "adapter_model.safetensors", path / "adapter_config.json"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if ".lora_A." in k)
    if damage == "shape":
        tensors[key] = torch.zeros(4, 3)
    elif damage == "drop_b":
        del tensors[key.replace(".lora_A.", ".lora_B.")]
    elif damage == "rename":
        tensors[key.replace(".self_attn.", ".nope_attn.")] = tensors.pop(key)
    if damage in ("shape", "drop_b", "rename"):
        save_file(tensors, str(weights))
    elif damage == "config":
        cfg_file.write_text("{not json")
    elif damage == "dora":
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "use_dora": True}))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=reason):
        eng.load_weights(path, 1)
    assert eng.version == 0 and all(torch.equal(eng.model.state_dict()[k], v) for k, v in before.items())


def test_vllm_rank_and_flags():
    assert [vllm_max_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    from asyncrl.inference.vllm.server import vllm_cli_args

    cfg = compose_config(
        [
            "inference.backend=vllm",
            "model=hf",
            "model.name=Qwen/Qwen3-0.6B",
            "model.lora.enabled=true",
            "model.lora.r=24",
        ]
    )
    args = vllm_cli_args(cfg, 8000)
    assert "--enable-lora" in args and args[args.index("--max-lora-rank") + 1] == "32"
    assert args[args.index("--max-loras") + 1] == "1"
    i = args.index("--lora-target-modules")
    assert args[i + 1 : i + 5] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert "--enable-lora" not in vllm_cli_args(compose_config(["inference.backend=vllm", "model=hf"]), 8000)


def test_lora_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.lora.enabled=true needs weights.transport=filesystem"):
        compose_config(
            ["model.lora.enabled=true", "weights.transport=nccl", "inference.backend=vllm", "model=hf"]
        )
    with pytest.raises(ConfigError, match="model.lora.target_modules is empty"):
        compose_config(["model.lora.enabled=true", "model.lora.target_modules=[]"])
    with pytest.raises(ConfigError, match="model.lora.r"):
        compose_config(["model.lora.r=0"])


def test_target_modules_that_match_nothing_name_the_key(micro_model):
    from asyncrl.models.hf import load_model

    with pytest.raises(ValueError, match="model.lora.target_modules"):
        apply_lora(
            load_model(ModelConfig(name=str(micro_model))), LoRAConfig(enabled=True, target_modules=["nope"])
        )


def test_merge_lora_command_writes_a_plain_model(micro_model, tmp_path):
    peft_model = adapter(micro_model, tmp_path / "a", 1)
    out = tmp_path / "merged"
    proc = asyncrl("merge-lora", str(tmp_path / "a"), str(out))
    assert proc.returncode == 0, proc.stderr
    merged = load_file(str(out / "model.safetensors"))
    for k, v in peft_model.merge_and_unload().state_dict().items():
        if k in merged:
            torch.testing.assert_close(merged[k], v, rtol=1e-6, atol=1e-6)
    assert (out / "tokenizer_config.json").exists() and (out / "STABLE").exists()
    bad = asyncrl("merge-lora", str(micro_model), str(out))
    assert bad.returncode == 2 and "not a LoRA adapter" in bad.stderr
