"""The RL losses on hand-computed cases: ratio, DPPO masks, KL term, token-mean normalisation, PPO-clip,
GSPO, CISPO, the KL penalty against a reference and its adaptive weight."""

import math

import pytest
import torch

from asyncrl.config.trainer import CISPOSettings, DPPOKLSettings, GRPOSettings, GSPOSettings, LossConfig
from asyncrl.models.logprobs import compute_logprobs
from asyncrl.trainer.loss import LossInputs, adapt_kl_beta, rl_loss, sequence_ids, sft_loss


def t(*rows):
    return torch.tensor([list(rows)], dtype=torch.float32)


def test_on_policy_loss_is_minus_mean_advantage():
    # log pi == log mu: ratio 1, nothing masked, no KL; loss = -(sum A) / total_tokens
    lp = t(-1.0, -2.0, -0.5)
    loss, m = rl_loss(
        LossInputs(lp, lp.clone(), t(0.5, -0.25, 1.0), torch.tensor([[True, True, True]]), 3), LossConfig()
    )
    assert loss.item() == pytest.approx(-(0.5 - 0.25 + 1.0) / 3)
    assert m["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["tokens"] == 3


def test_importance_ratio_and_kl_term():
    cfg = LossConfig(kl_tau=0.1, dppo_kl=DPPOKLSettings(mask_low=10, mask_high=10))  # masks out of the way
    lp, mu, adv = t(math.log(0.3)), t(math.log(0.2)), t(2.0)
    loss, m = rl_loss(LossInputs(lp, mu, adv, torch.tensor([[True]]), 1), cfg)
    ratio = 0.3 / 0.2
    log_ratio = math.log(ratio)
    assert loss.item() == pytest.approx(-2.0 * ratio + 0.1 * log_ratio**2, rel=1e-6)
    assert m["mismatch_kl"] == pytest.approx(ratio - log_ratio - 1, rel=1e-5)


def test_dppo_mask_by_advantage_sign():
    cfg = LossConfig(dppo_kl=DPPOKLSettings(mask_low=0.2, mask_high=0.2), kl_tau=0.0)
    mu = t(math.log(0.5), math.log(0.5), math.log(0.5), math.log(0.5))
    pi = t(math.log(0.8), math.log(0.8), math.log(0.2), math.log(0.6))  # delta: +0.3, +0.3, -0.3, +0.1
    adv = t(1.0, -1.0, -1.0, 1.0)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = rl_loss(LossInputs(pi, mu, adv, mask, 4), cfg)
    # token 0: A>0 and prob rose by 0.3 > 0.2 -> masked; token 2: A<0 and prob fell by 0.3 -> masked
    kept = -(-1.0 * 0.8 / 0.5) - (1.0 * 0.6 / 0.5)
    assert loss.item() == pytest.approx(kept / 4, rel=1e-6)
    assert m["masked_high"] == 1 and m["masked_low"] == 1


def test_masked_tokens_keep_kl_and_count_in_denominator():
    cfg = LossConfig(dppo_kl=DPPOKLSettings(mask_high=0.1), kl_tau=1.0)
    pi, mu = t(math.log(0.9)), t(math.log(0.5))
    loss, _ = rl_loss(LossInputs(pi, mu, t(1.0), torch.tensor([[True]]), 4), cfg)
    assert loss.item() == pytest.approx(math.log(0.9 / 0.5) ** 2 / 4, rel=1e-6)


def test_loss_mask_and_step_normalisation():
    lp = t(-1.0, -1.0, -1.0, -1.0)
    mask = torch.tensor([[False, True, True, False]])
    loss, m = rl_loss(LossInputs(lp, lp.clone(), t(9.0, 1.0, 1.0, 9.0), mask, 10), LossConfig())
    assert loss.item() == pytest.approx(-2.0 / 10)  # divided by the step's token count, not this batch's
    assert m["tokens"] == 2


def test_grpo_clip():
    cfg = LossConfig(type="grpo", grpo=GRPOSettings(clip_low=0.2, clip_high=0.2), kl_tau=0.0)
    pi, mu = t(math.log(0.9), math.log(0.1)), t(math.log(0.5), math.log(0.5))
    loss, _ = rl_loss(LossInputs(pi, mu, t(1.0, -1.0), torch.ones(1, 2, dtype=torch.bool), 2), cfg)
    # ratio 1.8 clipped to 1.2 for A>0; ratio 0.2 with A<0: min(-0.2, -0.8) = -0.8
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, rel=1e-6)


def test_gradient_raises_logprob_of_positive_advantage():
    lp = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = rl_loss(
        LossInputs(lp, torch.tensor([[-1.0]]), t(0.5), torch.tensor([[True]]), 1), LossConfig()
    )
    loss.backward()
    assert lp.grad.item() < 0  # gradient descent increases log pi


def test_compute_logprobs_shift_and_temperature():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 2.0  # position 0 predicts token 2 (the token at position 1)
    ids = torch.tensor([[1, 2, 3]])
    temps = torch.tensor([[1.0, 2.0, 1.0]])  # token 1 was sampled at temperature 2
    lp = compute_logprobs(logits, ids, temps)
    expected = 1.0 - math.log(math.exp(1.0) + 3)  # logits / 2 -> [0, 0, 1, 0]
    assert lp.shape == (1, 2)
    assert lp[0, 0].item() == pytest.approx(expected, rel=1e-6)
    assert lp[0, 1].item() == pytest.approx(math.log(0.25), rel=1e-6)


def test_sft_loss():
    lp = t(-1.0, -2.0, -3.0)
    assert sft_loss(lp, torch.tensor([[False, True, True]]), 4).item() == pytest.approx(5.0 / 4)


def test_cispo_caps_the_weight_and_keeps_every_token_s_gradient():
    cfg = LossConfig(type="cispo", cispo=CISPOSettings(clip_high=0.28), kl_tau=0.0)
    pi = torch.tensor([[math.log(0.9), math.log(0.1)]], requires_grad=True)
    mu = t(math.log(0.5), math.log(0.5))
    loss, m = rl_loss(LossInputs(pi, mu, t(1.0, -1.0), torch.ones(1, 2, dtype=torch.bool), 2), cfg)
    # token 0: ratio 1.8 capped at 1.28, A=1; token 1: ratio 0.2 (no lower bound), A=-1; weights are
    # constants
    assert loss.item() == pytest.approx((-1.28 * math.log(0.9) + 0.2 * math.log(0.1)) / 2, rel=1e-6)
    loss.backward()
    # d/d log pi = -weight * A / tokens: the capped token still trains (PPO-clip would give it 0)
    assert pi.grad[0].tolist() == pytest.approx([-1.28 / 2, 0.2 / 2], rel=1e-6)
    assert m["masked_high"] == 1 and m["masked_low"] == 0


def test_sequence_ids_follow_position_resets():
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    assert sequence_ids(pos).tolist() == [[0, 0, 0, 1, 1], [5, 5, 6, 6, 6]]


def gspo_case(log_ratios, advantages, loss_mask, position_ids, cfg, total_sequences):
    """rl_loss with type gspo on one packed row (inputs unshifted, as the trainer has them)."""
    mu = torch.full((1, len(log_ratios)), -1.0)
    pi = (mu + torch.tensor([log_ratios])).requires_grad_(True)
    ids = sequence_ids(torch.tensor([position_ids]))[:, 1:]
    loss, m = rl_loss(
        LossInputs(
            pi,
            mu,
            torch.tensor([advantages]),
            torch.tensor([loss_mask]),
            sum(loss_mask),
            seq_ids=ids,
            total_sequences=total_sequences,
        ),
        cfg,
    )
    loss.backward()
    return loss, m, pi.grad[0].tolist()


def test_gspo_ratio_is_per_sequence_and_clipped_per_sequence():
    cfg = LossConfig(type="gspo", gspo=GSPOSettings(clip_low=3e-4, clip_high=4e-4), kl_tau=0.0)
    # one row, two samples of 3 positions: [p a a][p b b]; shifted, tokens 0-1 are a's, 2 is b's prompt, 3-4
    # b's
    loss, m, grad = gspo_case(
        log_ratios=[1e-4, 3e-4, 0.0, 1e-3, 1e-3],
        advantages=[1.0, 1.0, 0.0, 2.0, 2.0],
        loss_mask=[True, True, False, True, True],
        position_ids=[0, 1, 2, 0, 1, 2],
        cfg=cfg,
        total_sequences=2,
    )
    s_a = math.exp(2e-4)  # geometric mean of a's ratios, inside [1 - 3e-4, 1 + 4e-4]
    # b: s = exp(1e-3) > 1 + 4e-4 with A > 0: clipped, so its term is constant and its tokens get no gradient
    assert loss.item() == pytest.approx(-(s_a * 1.0 + 1.0004 * 2.0) / 2, rel=1e-7)
    # d/d log pi_t of -s_a * A / 2 with s_a = exp(mean of a's 2 log ratios): -s_a * A / 2 / 2
    assert grad == pytest.approx([-s_a / 4, -s_a / 4, 0.0, 0.0, 0.0], rel=1e-5, abs=1e-9)
    assert m["masked_high"] == 2 and m["masked_low"] == 0


def test_gspo_weighs_sequences_not_tokens():
    # on policy (s = 1): a 1-token sample with A=+1 and a 3-token sample with A=-1 cancel (token mean: +0.5)
    cfg = LossConfig(type="gspo", kl_tau=0.0)
    loss, _, grad = gspo_case(
        log_ratios=[0.0] * 5,
        advantages=[1.0, 0.0, -1.0, -1.0, -1.0],
        loss_mask=[True, False, True, True, True],
        position_ids=[0, 1, 0, 1, 2, 3],
        cfg=cfg,
        total_sequences=2,
    )
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    assert grad == pytest.approx([-0.5, 0.0, 1 / 6, 1 / 6, 1 / 6], rel=1e-6)  # -A / 2 sequences / its length


def test_gspo_without_sequences_is_a_clear_error():
    with pytest.raises(ValueError, match="gspo"):
        rl_loss(LossInputs(t(-1.0), t(-1.0), t(1.0), torch.tensor([[True]]), 1), LossConfig(type="gspo"))


def test_reference_kl_penalty_is_k3_per_loss_token():
    cfg = LossConfig(kl_tau=0.0)
    pi = torch.tensor([[math.log(0.4), math.log(0.5), math.log(0.9)]], requires_grad=True)
    ref = t(math.log(0.2), math.log(0.5), math.log(0.1))
    mask = torch.tensor([[True, True, False]])  # the third token is not a loss token
    loss, m = rl_loss(
        LossInputs(pi, pi.detach().clone(), t(0.0, 0.0, 0.0), mask, 4, ref_logprobs=ref, kl_beta=0.5), cfg
    )
    # k3 = r - log r - 1 with r = ref / pi: token 0 r = 0.5; token 1 r = 1 (no KL); normalised by the step's
    # 4 tokens
    k3 = 0.5 - math.log(0.5) - 1
    assert m["kl_ref"] == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3 / 4, rel=1e-6)
    loss.backward()
    # d k3 / d log pi = 1 - r: pushes log pi down where pi > ref; the reference itself gets no gradient
    assert pi.grad[0].tolist() == pytest.approx([0.5 * (1 - 0.5) / 4, 0.0, 0.0], abs=1e-7)


def test_reference_kl_is_measured_even_with_zero_weight():
    lp = t(-1.0)
    loss, m = rl_loss(
        LossInputs(lp, lp.clone(), t(1.0), torch.tensor([[True]]), 1, ref_logprobs=t(-2.0)), LossConfig()
    )
    assert loss.item() == pytest.approx(-1.0)
    assert m["kl_ref"] == pytest.approx(math.exp(-1.0) + 1.0 - 1.0, rel=1e-6)


@pytest.mark.parametrize(
    ("kl", "expected"),
    [
        (0.01, 0.1),  # on target: unchanged
        (0.015, 0.1 * (1 + 0.1 * 0.2)),  # 50% above: error clipped to +0.2
        (0.011, 0.1 * (1 + 0.1 * 0.1)),  # 10% above
        (0.0, 0.1 * (1 - 0.1 * 0.2)),  # far below: clipped to -0.2
    ],
)
def test_adaptive_beta_follows_the_kl_error(kl, expected):
    assert adapt_kl_beta(0.1, kl, target_kl=0.01, rate=0.1) == pytest.approx(expected, rel=1e-12)


def test_beta_is_fixed_without_a_target():
    assert adapt_kl_beta(0.3, 5.0, target_kl=0.0, rate=0.1) == 0.3


def test_token_entropy_in_chunks_equals_the_formula():
    from asyncrl.models.logprobs import token_entropy

    logp = torch.log_softmax(torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)), dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(token_entropy(logp, chunk=2), expected, atol=1e-6)
    uniform = torch.full((1, 1, 4), math.log(0.25))
    assert token_entropy(uniform).item() == pytest.approx(math.log(4))


def test_distillation_term_is_the_reverse_kl_policy_gradient():
    cfg = LossConfig(kl_tau=0.0, adv_tau=0.0)  # distillation alone
    pi = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    mu = t(math.log(0.4), math.log(0.2))
    teacher = t(math.log(0.25), math.log(0.4))
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = rl_loss(
        LossInputs(pi, mu, t(0.0, 0.0), mask, 2, teacher_logprobs=teacher, distill_weight=2.0), cfg
    )
    k = [math.log(0.5 / 0.25), math.log(0.2 / 0.4)]  # log pi - log teacher, per token
    ratio = [0.5 / 0.4, 1.0]
    assert loss.item() == pytest.approx(2.0 * (k[0] * ratio[0] + k[1] * ratio[1]) / 2, rel=1e-6)
    assert m["distill_kl"] == pytest.approx(k[0] + k[1], rel=1e-6)
    loss.backward()
    # d/d log pi: weight * (log pi - log teacher) * ratio / tokens: down where the student is above the
    # teacher
    assert pi.grad[0].tolist() == pytest.approx(
        [2.0 * k[0] * ratio[0] / 2, 2.0 * k[1] * ratio[1] / 2], rel=1e-6
    )


def test_compiled_logprobs_match_eager_values_and_gradients():
    """trainer.fabric.compile's fused log-softmax head (compiled_logprobs) computes compute_logprobs: same
    values and logit gradients (to rounding), and the uncompiled chunked head when entropies are asked
    for."""
    from asyncrl.trainer.forward import compiled_logprobs

    torch.manual_seed(0)
    logits = torch.randn(2, 9, 50, requires_grad=True)
    ids = torch.randint(0, 50, (2, 9))
    temps = torch.tensor([[1.0] * 9, [0.7] * 9])
    fused = compiled_logprobs()
    expected = compute_logprobs(logits, ids, temps)
    (grad_expected,) = torch.autograd.grad(expected.sum(), logits)
    got = fused(logits, ids, temps)
    (grad_got,) = torch.autograd.grad(got.sum(), logits)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_got, grad_expected, atol=1e-5, rtol=1e-5)
    found: list = []
    torch.testing.assert_close(fused(logits, ids, temps, found), expected, atol=1e-6, rtol=1e-6)
    assert found and found[0].shape == (2, 8)
    entropies: list = []
    compute_logprobs(logits, ids, temps, entropies)
    torch.testing.assert_close(found[0], entropies[0], atol=1e-6, rtol=1e-6)
    # another token count (each micro-batch has its own): compiled again with a symbolic one, same values
    logits, ids, temps = logits[:, :5].detach(), ids[:, :5], temps[:, :5]
    torch.testing.assert_close(
        fused(logits, ids, temps), compute_logprobs(logits, ids, temps), atol=1e-5, rtol=1e-5
    )


def test_sampled_logprobs_custom_backward_is_compute_logprobs_gradient():
    """The hand-written backward of the fused head (sampled_logprobs), uncompiled, in fp32 and from bf16
    logits."""
    from asyncrl.models.logprobs import sampled_logprobs

    torch.manual_seed(1)
    ids = torch.randint(0, 40, (3, 7))
    temps = torch.rand(3, 7) + 0.5
    weights = torch.randn(3, 6)  # a loss that weighs tokens differently
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = torch.randn(3, 7, 40).to(dtype).requires_grad_(True)
        expected = compute_logprobs(logits, ids, temps)
        (grad_expected,) = torch.autograd.grad((expected * weights).sum(), logits)
        got = sampled_logprobs(logits, ids, temps)
        (grad_got,) = torch.autograd.grad((got * weights).sum(), logits)
        assert got.dtype == torch.float32 and grad_got.dtype == dtype
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad_got.float(), grad_expected.float(), atol=tol, rtol=tol)


def test_unread_metrics_are_the_read_ones_left_on_the_device():
    """``read_metrics=False`` (the trainer's step reads them once, with the losses): the same sums, as 0-dim
    fp64 tensors, and the same loss."""
    pi, mu = t(-1.0, -0.5, -2.0), t(-1.1, -0.4, -2.0)
    inputs = LossInputs(
        pi, mu, t(0.5, -1.0, 1.0), torch.tensor([[True, True, False]]), 3, ref_logprobs=t(-1.2, -0.5, -1.0)
    )
    loss, read = rl_loss(inputs, LossConfig())
    loss2, unread = rl_loss(inputs, LossConfig(), read_metrics=False)
    assert torch.equal(loss, loss2) and read.keys() == unread.keys()
    for k, v in unread.items():
        assert isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.dim() == 0
        assert v.item() == read[k]
