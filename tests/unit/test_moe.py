"""A mixture of experts (Qwen3-MoE) from config: built offline, handed off in the checkpoint layout vLLM
loads (one tensor per expert), and loaded in place by the CPU engine, router and experts included."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl.config.compose import compose_config
from asyncrl.config.fields import ConfigError
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import GenRequest, HFEngine
from asyncrl.models.hf import load_tokenizer, publish_weights


def test_model_configs_compose_as_mixtures_of_experts():
    for name, experts, top_k in (("tiny_moe", 8, 2), ("qwen3_moe_shape", 32, 8)):
        init = compose_config([f"model={name}"]).model.init
        assert (init.architecture, init.num_experts, init.num_experts_per_tok) == (
            "Qwen3MoeForCausalLM",
            experts,
            top_k,
        )
    shape = compose_config(["model=qwen3_moe_shape"]).model.init
    assert (shape.tokenizer, shape.vocab_size) == ("qwen3", 151936)
    with pytest.raises(
        ConfigError, match="model.init.num_experts_per_tok=9 exceeds model.init.num_experts=8"
    ):
        compose_config(["model=tiny_moe", "model.init.num_experts_per_tok=9"])


def test_built_model_is_a_qwen3_moe(micro_moe):
    assert json.loads((micro_moe / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    config = AutoConfig.from_pretrained(micro_moe)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
    assert config.norm_topk_prob is True and config.mlp_only_layers == []  # every layer a MoE layer


def expected_moe_layout(config) -> dict[str, tuple[int, ...]]:
    """The per-expert checkpoint names and shapes of Qwen/Qwen3-30B-A3B's safetensors, which vLLM's Qwen3-MoE
    loader maps onto its fused experts (``mlp.experts.{e}.gate_proj`` ...), for every MoE layer of
    ``config``."""
    h, i, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    out: dict[str, tuple[int, ...]] = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp"
        out[f"{prefix}.gate.weight"] = (e, h)
        for x in range(e):
            out[f"{prefix}.experts.{x}.gate_proj.weight"] = (i, h)
            out[f"{prefix}.experts.{x}.up_proj.weight"] = (i, h)
            out[f"{prefix}.experts.{x}.down_proj.weight"] = (h, i)
    return out


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights, each moved by noise (the router's and the experts' included; the tied head with
    the embedding)."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def test_hand_off_holds_every_expert_in_the_checkpoint_layout(micro_moe, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(micro_moe)
    state = perturbed(model, 0)
    publish_weights(
        model, load_tokenizer(ModelConfig(name=str(micro_moe))), tmp_path / "w", state_dict=state
    )
    saved = load_file(str(tmp_path / "w" / "model.safetensors"))
    moe = {k: tuple(v.shape) for k, v in saved.items() if ".mlp." in k}
    assert moe == expected_moe_layout(model.config)
    i = model.config.moe_intermediate_size
    fused = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(saved["model.layers.1.mlp.experts.3.gate_proj.weight"], fused[3, :i])
    assert torch.equal(saved["model.layers.1.mlp.experts.3.up_proj.weight"], fused[3, i:])
    assert torch.equal(
        saved["model.layers.1.mlp.experts.2.down_proj.weight"],
        state["model.layers.1.mlp.experts.down_proj"][2],
    )


def test_engine_loads_expert_and_router_weights_in_place(micro_moe, tmp_path):
    engine = HFEngine(ModelConfig(name=str(micro_moe)), InferenceConfig(), seed=0)
    req = GenRequest(engine.tokenizer("abc").input_ids, max_tokens=8, temperature=0.0)
    before = engine.generate([req])[0][0]
    state = perturbed(engine.model, 1)
    # it drops tied names
    publish_weights(engine.model, engine.tokenizer, tmp_path / "w", state_dict=dict(state))
    engine.load_weights(tmp_path / "w", version=1)
    own = engine.model.state_dict()
    assert own.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(own[k], v), k  # the router (mlp.gate) and the fused experts too
    assert engine.generate([req])[0][0].logprobs != before.logprobs
    # one expert missing: refused whole, nothing served changes
    saved = load_file(str(tmp_path / "w" / "model.safetensors"))
    del saved["model.layers.0.mlp.experts.1.up_proj.weight"]
    (tmp_path / "w2").mkdir()
    save_file(saved, str(tmp_path / "w2" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(tmp_path / "w2", version=2)
    assert torch.equal(
        engine.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"],
        own["model.layers.0.mlp.experts.gate_up_proj"],
    )


def as_vllm_reads(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-expert checkpoint tensors vLLM 0.26's MoE loader takes a streamed tensor for: a 3-D expert
    tensor is split per expert, ``gate_up_proj`` chunked in two along dim 1 into gate (w1) and up (w3),
    ``down_proj`` as it is (``RoutedExperts.load_weights``,
    vllm/model_executor/layers/fused_moe/routed_experts.py lines 869-930, with the fused names of
    ``build_expert_params_mapping``, lines 1049-1053); any other tensor under its own name."""
    prefix, _, leaf = name.rpartition(".")
    if tensor.dim() != 3 or not prefix.endswith(".mlp.experts"):
        return {name: tensor}
    parts = (
        dict(zip(("gate", "up"), tensor.chunk(2, dim=1), strict=True))
        if leaf == "gate_up_proj"
        else {"down": tensor}
    )
    return {f"{prefix}.{e}.{p}_proj.weight": t[e] for p, t in parts.items() for e in range(t.shape[0])}


def test_streamed_hand_off_is_the_checkpoint_as_vllm_reads_it(micro_moe, tmp_path):
    """What the NCCL and IPC publishers send of a mixture of experts (the fused tensors, gathered as one full
    tensor each) is, read as vLLM's loader reads it, the per-expert checkpoint the files hold: the same
    names, shapes and values."""
    from asyncrl.transport.gather import iter_full
    from asyncrl.transport.streamed import export_entries

    model = AutoModelForCausalLM.from_pretrained(micro_moe)
    model.load_state_dict(perturbed(model, 2))
    streamed = dict(iter_full(model, torch.bfloat16))
    assert [(n, list(t.shape)) for n, t in streamed.items()] == [
        (n, s) for n, _, s in export_entries(model, torch.bfloat16)
    ]
    # fused: two tensors a layer, not 3 x experts
    assert "model.layers.0.mlp.experts.gate_up_proj" in streamed
    publish_weights(model, load_tokenizer(ModelConfig(name=str(micro_moe))), tmp_path / "w")
    files = load_file(str(tmp_path / "w" / "model.safetensors"))
    read = {k: v for name, t in streamed.items() for k, v in as_vllm_reads(name, t).items()}
    assert read.keys() == files.keys()
    assert {k for k in read if ".mlp." in k} == set(expected_moe_layout(model.config))
    for name, tensor in files.items():
        assert read[name].shape == tensor.shape and torch.equal(read[name], tensor.to(torch.bfloat16)), name
