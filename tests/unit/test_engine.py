"""The CPU engine: seeded requests reproduce under any batching; sampling details."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.compose import compose_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.model import ModelConfig
from asyncrl.inference.builtin.engine import GenRequest, HFEngine
from asyncrl.inference.builtin.sampling import processed_logprobs
from asyncrl.models.hf import build_tiny_model, render_prompt
from helpers.launch import MICRO_MODEL


@pytest.fixture(scope="module")
def engine(micro_model):
    return HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)


def _requests(engine, n_prompts=6):
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


def test_top_k_1_and_min_p_1_sample_the_argmax_with_certainty(engine):
    """The sidecar honours vLLM's top_k and min_p: each keeps only the most likely token here, whose
    renormalised logprob is 0, and the completion is the greedy one."""
    req = _requests(engine, 1)[0]
    greedy = engine.generate([GenRequest(req.prompt_ids, max_tokens=8, temperature=0.0)])[0][0]
    for cut in ({"top_k": 1}, {"min_p": 1.0}):
        out = engine.generate([GenRequest(req.prompt_ids, max_tokens=8, temperature=1.0, seed=3, **cut)])[0][
            0
        ]
        assert out.token_ids == greedy.token_ids and out.logprobs == [0.0] * len(out.token_ids), cut


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
    # a prompt that fills the context: the routes' default max_tokens (the rest of the context) would be <= 0
    full = [7] * engine.max_model_len
    assert "no room" in engine.check(GenRequest(full, max_tokens=engine.max_model_len - len(full)))
    assert "no room" in engine.check(GenRequest(full + [7] * 40, max_tokens=-40))
    assert ">= 1" in engine.check(GenRequest([7], max_tokens=0))
    assert engine.check(GenRequest([7], max_tokens=4)) is None


def _long_prompt(engine, tokens: int) -> list[int]:
    ids = render_prompt(engine.tokenizer, [{"role": "user", "content": "z" * tokens}])
    assert len(ids) > engine.cfg.pad_multiple  # another padded width than the short prompts
    return ids


def test_a_request_is_the_same_next_to_a_prompt_of_another_width(engine):
    """The width a cohort is padded to depends only on its own prompts: a seeded request gives the same
    tokens and logprobs alone as next to a prompt longer than ``inference.pad_multiple`` (padding the whole
    batch to that prompt's width would change its neighbours' last bits)."""
    short = _requests(engine, 3)
    wide = GenRequest(_long_prompt(engine, 90), n=2, max_tokens=12, temperature=1.0, seed=7)
    alone = engine.generate(short)
    mixed = engine.generate([short[0], wide, short[1], short[2]])
    for a, b in zip(alone, [mixed[0], mixed[2], mixed[3]], strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
    assert mixed[1] == engine.generate([wide])[0]


def test_a_long_request_does_not_hold_back_a_new_one(engine):
    """Continuous batching: a request added while a long one decodes finishes first, with the same
    completion as when it runs alone."""
    long = GenRequest(_requests(engine, 1)[0].prompt_ids, n=2, max_tokens=60, temperature=1.0, seed=1)
    short = _requests(engine, 2)[1]
    short.max_tokens = 5
    first = engine.add([long])
    for _ in range(10):
        assert engine.step() == []
    second = engine.add([short])
    order, outs = [], {}
    while engine.busy:
        for job, out in engine.step():
            order.append(job)
            outs[job] = out
    assert order[0] == second  # done while the long one still runs
    assert all(len(c.token_ids) <= 5 for c in outs[second][0])
    assert outs[second] == engine.generate([short])
    assert outs[first] == engine.generate([long])


def test_a_weight_update_in_the_middle_of_a_completion(micro_model, tmp_path):
    """Weights loaded between two decode steps: tokens before the update are exactly those of the old policy,
    every token records the version whose forward produced it, and each logprob after the update is the new
    model's given the cache the old one computed (what the trainer's importance ratio divides by)."""

    other = build_tiny_model(compose_config(MICRO_MODEL).model.init, tmp_path / "v1", seed=1)
    eng = HFEngine(ModelConfig(name=str(micro_model)), InferenceConfig(), seed=0)
    req = GenRequest(_requests(eng, 1)[0].prompt_ids, n=1, max_tokens=40, temperature=1.0, seed=3)
    (before,) = eng.generate([req])[0]
    assert len(before.token_ids) > 12 and set(before.versions) == {0}
    old = {k: v.clone() for k, v in eng.model.state_dict().items()}
    k = 8
    eng.add([req])
    for _ in range(k):
        assert eng.step() == []
    eng.load_weights(other, 1)
    while not (done := eng.step()):
        pass
    (c,) = done[0][1][0]
    # the token sampled in the step right after the update came from logits the old weights computed
    assert c.versions == [0] * (k + 1) + [1] * (len(c.token_ids) - k - 1)
    assert (
        c.token_ids[: k + 1] == before.token_ids[: k + 1] and c.logprobs[: k + 1] == before.logprobs[: k + 1]
    )
    assert c.token_ids != before.token_ids  # the new policy went its own way

    # reference: the old model's cache over the prompt and the first k tokens, then the new model

    ref_old = AutoModelForCausalLM.from_pretrained(micro_model).eval()
    ref_old.load_state_dict(old)
    ref_new = AutoModelForCausalLM.from_pretrained(other).eval()
    with torch.no_grad():
        prefix = torch.tensor([req.prompt_ids + c.token_ids[:k]])
        cache = ref_old(input_ids=prefix, use_cache=True).past_key_values
        logits = ref_new(input_ids=torch.tensor([c.token_ids[k:-1]]), past_key_values=cache).logits[0]
    ref = (
        torch.log_softmax(logits.double(), -1)
        .gather(-1, torch.tensor(c.token_ids[k + 1 :])[:, None])
        .squeeze(-1)
    )
    torch.testing.assert_close(
        torch.tensor(c.logprobs[k + 1 :], dtype=torch.float64), ref, rtol=0, atol=1e-5
    )
