"""The CPU engine: seeded requests reproduce under any batching; sampling details."""

import pytest
import torch

from asyncrl.config.sections import InferenceConfig, ModelConfig
from asyncrl.inference.engine import GenRequest, HFEngine
from asyncrl.inference.sampling import processed_logprobs


@pytest.fixture(scope="module")
def engine(micro_model):
    return HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)


def _requests(engine, n_prompts=6):
    from asyncrl.models import render_prompt

    texts = ["abc", "hello", "qwerty zx", "a", "lorem ipsum do", "xyz"][:n_prompts]
    return [
        GenRequest(
            render_prompt(engine.tokenizer, [{"role": "user", "content": t}]),
            n=1 + i % 4,
            max_tokens=12,
            temperature=1.0,
            seed=100 + i,
            top_p=0.9 if i == 2 else 1.0,
        )
        for i, t in enumerate(texts)
    ]


def test_seeded_requests_do_not_depend_on_batching(engine):
    reqs = _requests(engine)
    together = engine.generate(reqs)
    for k in range(len(reqs)):
        for group in ([k], [k, (k + 2) % len(reqs)], list(range(k + 1))):
            alone = engine.generate([reqs[i] for i in group])[group.index(k)]
            for a, b in zip(alone, together[k], strict=True):
                assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_greedy_is_deterministic_and_stops(engine):
    req = _requests(engine, 1)[0]
    req.temperature, req.n = 0.0, 3
    outs = engine.generate([req])[0]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert all(o.finish_reason in ("stop", "length") and len(o.token_ids) <= 12 for o in outs)


def test_logprobs_match_a_plain_forward(engine):
    req = _requests(engine, 1)[0]
    out = engine.generate([req])[0][0]
    ids = torch.tensor([req.prompt_ids + out.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(req.prompt_ids) - 1 : -1]
    ref = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-5)


def test_top_p_renormalises():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = processed_logprobs(logits, torch.tensor([1.0]), torch.tensor([0.7]))
    # 0.5 + 0.3 reach 0.7: the nucleus is the first two tokens, renormalised
    assert lp.exp()[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])


def test_stop_strings_cut_text(engine):
    req = _requests(engine, 1)[0]
    first = engine.generate([req])[0][0]
    if len(first.text) >= 3:
        req.stop = [first.text[1:3]]
        out = engine.generate([req])[0][0]
        assert out.finish_reason == "stop" and out.text == first.text[:1]


def test_check_rejects_bad_requests(engine):
    assert "empty" in engine.check(GenRequest([], max_tokens=1))
    assert "out of range" in engine.check(GenRequest([10**6], max_tokens=1))
    assert "exceeds" in engine.check(GenRequest([7], max_tokens=10**6))
    assert engine.check(GenRequest([7], max_tokens=4)) is None
