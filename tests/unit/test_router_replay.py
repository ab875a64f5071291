"""Router replay: a Qwen3-MoE forward routed to given experts, with the router's weights still computed and
differentiated as in the model."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.compose import compose_config
from asyncrl.config.fields import ConfigError
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import GenRequest, HFEngine
from asyncrl.inference.vllm.server import vllm_cli_args
from asyncrl.models.moe import Routing, routers
from asyncrl.rollouts.answers import read_chat, routes_array
from asyncrl.rollouts.packing import Sample, pack_samples, truncate


@pytest.fixture
def model(micro_moe):
    return AutoModelForCausalLM.from_pretrained(micro_moe).train()


def forward_and_grads(model, ids, routing=None, routes=None):
    """Logits of ``ids`` and the gradients of a loss on them, routed by ``routes`` when given."""
    model.zero_grad()
    if routing is None:
        logits = model(input_ids=ids).logits
    else:
        with routing.given(routes):
            logits = model(input_ids=ids).logits
    (logits.float() * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def own_routes(model, ids) -> torch.Tensor:
    """``[batch, tokens, MoE layers, top_k]``: the experts the model routes ``ids`` to, in its order."""
    routing = Routing(model)
    with torch.no_grad(), routing.record() as picks:
        model(input_ids=ids)
    routing.remove()
    return torch.stack(picks, dim=1).reshape(*ids.shape, len(picks), -1)


IDS = torch.tensor([[5, 9, 3, 7, 12, 4, 8, 20], [2, 6, 11, 13, 3, 3, 9, 1]])


def test_replaying_the_models_own_routes_changes_nothing(model):
    routes = own_routes(model, IDS)
    assert routes.shape == (2, 8, model.config.num_hidden_layers, 2)
    ref_logits, ref_grads = forward_and_grads(model, IDS)
    routing = Routing(model, replay=True)
    logits, grads = forward_and_grads(model, IDS, routing, routes)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and any(".mlp.gate." in n for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    assert routing.take() == {"moe_tokens": 16.0, "moe_routes_differ": 0.0, "moe_router_disagrees": 0.0}


def test_other_routes_change_the_output_and_the_router_still_learns(model):
    routes = own_routes(model, IDS)
    # every token to other experts (still distinct per token)
    other = (routes + 1) % model.config.num_experts
    other[1, 4:] = -1  # no route given: the router's own choice
    ref_logits, _ = forward_and_grads(model, IDS)
    routing = Routing(model, replay=True)
    logits, grads = forward_and_grads(model, IDS, routing, other)
    assert not torch.equal(logits[0], ref_logits[0])
    gates = [n for n in grads if ".mlp.gate." in n]
    assert len(gates) == len(routers(model)) and all(grads[n].abs().sum() > 0 for n in gates)
    counts = routing.take()
    assert counts["moe_tokens"] == 12 and counts["moe_routes_differ"] == 0  # the given routes were used
    assert 0 < counts["moe_router_disagrees"] <= 12  # which the router would not have picked
    # without replay the same routes are only compared: the model's own output, the differences counted as
    # used
    routing.remove()
    compare = Routing(model, replay=False)
    logits, _ = forward_and_grads(model, IDS, compare, other)
    assert torch.equal(logits, ref_logits)
    assert compare.take()["moe_routes_differ"] == counts["moe_router_disagrees"]


def test_engine_returns_the_routes_of_every_token_it_read(micro_moe):
    engine = HFEngine(ModelConfig(name=str(micro_moe)), InferenceConfig(), seed=0)
    prompts = [engine.tokenizer(t).input_ids for t in ("abc", "hello there", "xy")]
    reqs = [GenRequest(p, n=2, max_tokens=10, seed=i, routed_experts=i != 2) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    assert all(c.routed_experts is None for c in outs[2])  # not asked
    for req, choices in zip(reqs[:2], outs[:2], strict=True):
        for c in choices:
            read = req.prompt_ids + c.token_ids[:-1]  # the last token is sampled, never read
            assert c.routed_experts.dtype == np.int16
            assert c.routed_experts.shape == (len(read), engine.model.config.num_hidden_layers, 2)
            # the decode's routes (KV cache, padded batch) are those a plain forward of the same tokens picks
            expected = own_routes(engine.model, torch.tensor([read]))[0]
            assert torch.equal(torch.from_numpy(c.routed_experts).long(), expected)


def test_packing_places_each_samples_routes_at_its_tokens():
    def routes(n: int, first: int) -> np.ndarray:
        return (np.arange(n * 2 * 2).reshape(n, 2, 2) + first).astype(np.int16)

    a = Sample([1, 2], [3, 4, 5], [-1.0] * 3, 1.0, routed_experts=routes(4, 0))  # its last token has none
    b = Sample([6], [7, 8], [-1.0] * 2, -1.0, routed_experts=routes(2, 100))
    c = Sample([9, 9], [9], [-1.0], 0.5)  # no routes known: the trainer's router decides
    (mb,) = pack_samples([a, b, c], seq_len=16, pad_id=0, pad_multiple=16)
    row = mb["routed_experts"][0]
    assert mb["routed_experts"].dtype == np.int16 and row.shape == (16, 2, 2)
    ids = mb["input_ids"][0].tolist()
    assert ids[:5] == [1, 2, 3, 4, 5] and ids[5:8] == [6, 7, 8]  # longest first
    assert (row[:4] == a.routed_experts).all() and (row[4:5] == -1).all()
    assert (row[5:7] == b.routed_experts).all() and (row[7:] == -1).all()
    cut = truncate(a, 3)
    assert cut is not None and (cut.routed_experts == a.routed_experts[:3]).all()
    with pytest.raises(ValueError, match="routes of 5 tokens"):
        Sample([1], [2, 3], [0.0, 0.0], 0.0, routed_experts=routes(5, 0))
    # a dense model's rollouts: as before
    assert "routed_experts" not in pack_samples([c], seq_len=16, pad_id=0)[0]


def test_router_replay_needs_the_sidecars_routes():
    with pytest.raises(
        ConfigError, match="trainer.router_replay=true needs orchestrator.routed_experts=true"
    ):
        compose_config(["trainer.router_replay=true"])
    cfg = compose_config(
        ["orchestrator.routed_experts=true", "trainer.router_replay=true", "inference.backend=vllm"]
    )
    assert "--enable-return-routed-experts" in vllm_cli_args(cfg, 8000)
    assert "--enable-return-routed-experts" not in vllm_cli_args(
        compose_config(["inference.backend=vllm"]), 8000
    )


def test_routes_of_another_layer_count_are_refused(model):
    routing = Routing(model, replay=True)
    routes = own_routes(model, IDS)
    with pytest.raises(ValueError, match="cover 3 layers, the model has 2 MoE layers"):
        with routing.given(torch.cat([routes, routes[:, :, :1]], dim=2)):
            pass


def vllm_routes(routes: np.ndarray) -> str:
    """``routes`` as vLLM 0.26's chat route answers them: ``np.save`` into a byte buffer, base64 (ASCII)
    (vllm/entrypoints/openai/chat_completion/serving.py lines 985-989), of the uint8 array its scheduler
    keeps for up to 256 experts (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py line
    279)."""
    buf = io.BytesIO()
    np.save(buf, routes.astype(np.uint8))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def test_the_client_reads_either_sidecars_routes():
    """A choice's routed_experts, [prompt + completion - 1][layers][top_k], as the built-in sidecar answers
    them (lists) and as vLLM does (base64 .npy): the same int16 array."""
    routes = np.random.default_rng(0).integers(0, 128, size=(6, 3, 8))
    choice = {"index": 0, "token_ids": [4, 5, 6], "logprobs": {"content": [{"logprob": -1.0}] * 3}}
    choice.update(message={"content": "abc"}, finish_reason="stop")
    got = []
    for answered in (routes.tolist(), vllm_routes(routes)):
        out = read_chat(
            {"choices": [{**choice, "routed_experts": answered}], "prompt_token_ids": [1, 2, 3, 4]}, "u", 0
        )
        got.append(out.choices[0].routed_experts)
    for g in got:
        assert g.dtype == np.int16 and g.shape == (6, 3, 8) and (g == routes).all()
    assert routes_array(None) is None
    with pytest.raises(RuntimeError, match="not a base64 .npy array"):
        routes_array("bm90IGFuIG5weQ==")  # base64 of something else
    flat = io.BytesIO()
    np.save(flat, np.zeros(4, dtype=np.uint8))
    with pytest.raises(RuntimeError, match=r"shape \(4,\)"):
        routes_array(base64.b64encode(flat.getvalue()).decode())
