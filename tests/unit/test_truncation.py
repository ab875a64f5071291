"""Top-k / top-p / min-p: the trainer scores a sampled token under the truncated, renormalised distribution
the sampler drew it from (asyncrl.models.truncation), on hand-computed distributions."""

import math

import pytest
import torch

from asyncrl.inference.builtin.sampling import processed_logprobs
from asyncrl.models import logprobs as lp
from asyncrl.models.truncation import Truncation, kept_set

P = [0.4, 0.3, 0.2, 0.06, 0.04]


def _batch(probs: list[float], target: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """Logits whose position 0 has softmax ``probs`` and predicts token ``target`` (``input_ids``
    ``[0, target]``), and the micro-batch arrays recording the truncation it was sampled under."""
    logits = (
        torch.log(torch.tensor(probs, dtype=torch.float64)).float().expand(1, 2, len(probs)).contiguous()
    )
    # entry i is about token i (as packed): the prompt token 0 carries the neutral settings, the target its
    # own
    mb = {
        "top_ks": torch.tensor([[0, top_k]]),
        "top_ps": torch.tensor([[1.0, top_p]]),
        "min_ps": torch.tensor([[0.0, min_p]]),
    }
    return logits, torch.tensor([[0, target]]), torch.ones(1, 2), mb


def test_the_biased_ratio_is_off_by_exactly_the_log_of_the_kept_mass():
    # top_p 0.7 keeps 0.4 + 0.3 (the mass before 0.2 is 0.7, not < 0.7): kept mass 0.7
    logits, ids, temps, mb = _batch(P, 0, top_p=0.7)
    full = lp.compute_logprobs(logits, ids, temps)
    exact = lp.compute_logprobs(logits, ids, temps, truncation=Truncation.of(mb))
    assert full.item() == pytest.approx(math.log(0.4), abs=1e-6)
    assert exact.item() == pytest.approx(math.log(0.4 / 0.7), abs=1e-6)
    assert (exact - full).item() == pytest.approx(-math.log(0.7), abs=1e-6)
    # what the sidecar returns for the same distribution is the exact one
    sidecar = processed_logprobs(logits[0, :1], torch.ones(1), torch.tensor([0.7]))[0, 0]
    assert exact.item() == pytest.approx(sidecar.item(), abs=1e-6)


# each rule alone, and all three (min-p, then top-k, then top-p on what is left, renormalised)
CASES = [
    ({"top_k": 2}, [0.4, 0.3]),
    ({"top_p": 0.75}, [0.4, 0.3, 0.2]),  # the mass before 0.2 is 0.7 < 0.75; before 0.06 it is 0.9
    ({"min_p": 0.125}, [0.4, 0.3, 0.2, 0.06]),  # below 0.125 x 0.4 = 0.05: 0.04 goes
    # min_p drops 0.04, top_k 3 keeps 0.4, 0.3, 0.2 (renormalised: 4/9, 3/9, 2/9), then top_p 0.75 of that
    # drops 0.2 (7/9 before it); top_p 0.75 on the whole distribution would have kept it
    ({"min_p": 0.125, "top_k": 3, "top_p": 0.75}, [0.4, 0.3]),
]


@pytest.mark.parametrize(("settings", "kept"), CASES)
def test_truncated_logprobs_match_a_hand_computation(settings, kept):
    expected = [math.log(p / sum(kept)) for p in kept] + [float("-inf")] * (len(P) - len(kept))
    for target in range(len(kept)):
        logits, ids, temps, mb = _batch(P, target, **settings)
        for score in (lp.compute_logprobs, lp.chunked_logprobs):
            cut = Truncation.of(mb)
            out = score(logits, ids, temps, truncation=cut)
            assert out.item() == pytest.approx(expected[target], abs=1e-6), (score.__name__, target)
            assert cut.outside is not None and not cut.outside.any()
    row = torch.log(torch.tensor([P], dtype=torch.float64))
    k, p, m = (torch.tensor([settings.get(n, d)]) for n, d in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)))
    sidecar = processed_logprobs(row, torch.ones(1), p, k, m)[0]
    assert sidecar.tolist() == pytest.approx(expected, abs=1e-12)
    floor = kept_set(row, k, p, m).floor.item()
    assert math.log(P[len(kept)]) < floor <= math.log(kept[-1]) if len(kept) < len(P) else floor == -math.inf


def test_top_p_cuts_ties_where_vllms_sort_does():
    """Values rounded from bf16 tie often. vLLM's top-p cuts its ascending, stable sort at a position, so of
    the values tied at the cut it keeps those at higher indices: the kept set (and the renormalised logprobs)
    follow vLLM's rule (apply_top_k_top_p_pytorch, written out here), not "every value tied with the
    floor"."""
    # four tokens tie at 0.1; sorted ascending (ties by index) the mass runs 0.05, 0.15 (index 1), 0.25
    # (index 3), 0.35 (index 4): top_p 0.7 drops the positions with mass <= 0.3, so two of the tied tokens (4
    # and 6) stay
    probs = [0.3, 0.1, 0.25, 0.1, 0.1, 0.05, 0.1]
    row = torch.log(torch.tensor([probs], dtype=torch.float64)).float()
    k, p, m = torch.tensor([0]), torch.tensor([0.7]), torch.tensor([0.0])

    def vllm_rule(logits):  # vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch, top-p only
        logits_sort, logits_idx = logits.sort(dim=-1, descending=False, stable=True)
        probs_sum = torch.cumsum(logits_sort.softmax(dim=-1, dtype=torch.float32), dim=-1)
        mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        mask[:, -1] = False
        return logits.clone().scatter_(-1, logits_idx, logits_sort.masked_fill(mask, -float("inf")))

    theirs = torch.isfinite(vllm_rule(row))
    ours = ~kept_set(row, k, p, m).drops(row)
    assert theirs.tolist() == [[True, False, True, False, True, False, True]]
    assert torch.equal(ours, theirs)
    # the trainer's logprob of a kept tied token is the sidecar's: mass 0.3 + 0.25 + 0.1 + 0.1
    logits, ids, temps, mb = _batch(probs, 4, top_p=0.7)
    for score in (lp.compute_logprobs, lp.chunked_logprobs):
        cut = Truncation.of(mb)
        assert score(logits, ids, temps, truncation=cut).item() == pytest.approx(
            math.log(0.1 / 0.75), abs=1e-6
        )
        assert not cut.outside.any()
    sidecar = processed_logprobs(logits[0, :1], torch.ones(1), p)[0]
    assert torch.isfinite(sidecar).tolist() == theirs[0].tolist()
    # a tied token the cut dropped, sampled anyway (rounding), widens the set to every tie, and is counted
    logits, ids, temps, mb = _batch(probs, 3, top_p=0.7)
    cut = Truncation.of(mb)
    widened = lp.chunked_logprobs(logits, ids, temps, truncation=cut).item()
    assert widened == pytest.approx(math.log(0.1 / 0.95), abs=1e-6)
    assert cut.outside.tolist() == [[True]]


def test_a_token_below_the_kept_set_is_scored_among_those_at_least_as_likely_and_counted():
    # top_k 1 keeps 0.4 only; a sampled 0.2 (a tie broken otherwise, or rounding) counts 0.4, 0.3 and itself
    logits, ids, temps, mb = _batch(P, 2, top_k=1)
    for score in (lp.compute_logprobs, lp.chunked_logprobs):
        cut = Truncation.of(mb)
        out = score(logits, ids, temps, truncation=cut)
        assert out.item() == pytest.approx(math.log(0.2 / 0.9), abs=1e-6)
        assert cut.outside is not None and cut.outside.tolist() == [[True]]


def test_the_chunked_head_matches_the_eager_one_under_truncation(monkeypatch):
    """Values, gradients and entropies agree across several chunks, with rows of different settings (and
    neutral ones: prompt positions), and a masked value's gradient is 0."""
    monkeypatch.setattr(lp, "CHUNK", 3)
    g = torch.Generator().manual_seed(0)
    b, t, v = 2, 8, 11
    logits = (3 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).float()
    ids = torch.randint(v, (b, t), generator=g)
    temps = torch.full((b, t), 0.8)
    mb = {
        "top_ks": torch.randint(0, 6, (b, t), generator=g),
        "top_ps": torch.rand(b, t, generator=g) * 0.5 + 0.5,
        "min_ps": torch.rand(b, t, generator=g) * 0.1,
    }
    results = []
    for score in (lp.compute_logprobs, lp.chunked_logprobs):
        x = logits.clone().requires_grad_(True)
        entropies: list = []
        cut = Truncation.of(mb)
        out = score(x, ids, temps, entropies, truncation=cut)
        out.sum().backward()
        results.append((out.detach(), x.grad, entropies[0], cut.outside))
    (a, ga, ea, oa), (c, gc, ec, oc) = results
    torch.testing.assert_close(a, c, rtol=0, atol=1e-5)
    torch.testing.assert_close(ga, gc, rtol=0, atol=1e-5)
    torch.testing.assert_close(ea, ec, rtol=0, atol=1e-5)
    assert torch.equal(oa, oc)
    assert torch.isfinite(ea).all() and (ga == 0).any()
