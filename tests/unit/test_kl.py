"""The KL penalty to the reference policy: the k1/k2/k3 estimators and their place in the GRPO loss."""

from __future__ import annotations

import math

import pytest
import torch

from colocate.config import AlgoConfig, JobConfig
from colocate.errors import ConfigError
from colocate.trainer.loss import KL_CLAMP, Sequence, collate, kl_estimator, policy_loss

CPU = torch.device("cpu")


def test_estimators_on_known_values():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])  # log r = log(ref / p) = -log 2, +log 2
    log2 = math.log(2)
    torch.testing.assert_close(kl_estimator(logp, ref, "k1"), torch.tensor([log2, -log2]))
    torch.testing.assert_close(kl_estimator(logp, ref, "k2"), torch.tensor([log2 ** 2 / 2] * 2))
    torch.testing.assert_close(kl_estimator(logp, ref, "k3"), torch.tensor([0.5 - 1 + log2, 2.0 - 1 - log2]))


def test_estimators_are_zero_when_the_policy_is_the_reference():
    logp = torch.log_softmax(torch.randn(3, 7), dim=-1)
    for estimator in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimator(logp, logp.clone(), estimator), torch.zeros_like(logp)), estimator


def test_k3_is_non_negative_and_finite_even_for_a_floored_logprob():
    torch.manual_seed(0)
    logp, ref = torch.randn(1000) * 3, torch.randn(1000) * 3
    assert (kl_estimator(logp, ref, "k3") >= 0).all()
    # a token the trainer floors at -100 but the reference does not: e^100 overflows fp32 without the clamp
    far = kl_estimator(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(far).all() and far.item() == pytest.approx(math.exp(KL_CLAMP) - 1 - KL_CLAMP)


def test_k3_gradient_pulls_the_policy_toward_the_reference():
    ref = torch.tensor([-1.0, -1.0])
    logp = torch.tensor([-0.5, -2.0], requires_grad=True)  # above the reference, below it
    kl_estimator(logp, ref, "k3").sum().backward()
    # d k3 / d logp = 1 - r = 1 - e^(logp_ref - logp): a descent step lowers the first and raises the second
    torch.testing.assert_close(logp.grad, 1 - torch.exp(ref - logp.detach()))
    assert logp.grad[0] > 0 > logp.grad[1]


def _batch():
    seqs = [Sequence([1, 2], [3, 4, 5], [-1.0, -2.0, -0.5], 1.0), Sequence([1], [6], [-0.3], -0.5)]
    return collate(seqs, pad_id=0, device=CPU)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_policy_loss_adds_kl_coef_times_the_masked_estimator(estimator):
    batch = _batch()
    mask = batch.target_mask
    torch.manual_seed(1)
    logprobs = batch.old_logprobs + 0.1 * torch.randn_like(mask)
    # the reference differs everywhere, padding included: only response tokens may count
    ref = logprobs - 0.3 + 0.2 * torch.randn_like(mask)
    base, base_stats = policy_loss(logprobs, batch, algo=AlgoConfig())
    loss, stats = policy_loss(logprobs, batch, algo=AlgoConfig(kl_coef=0.05, kl_estimator=estimator),
                              ref_logprobs=ref)
    kl = kl_estimator(logprobs, ref, estimator)
    expected = (kl * mask).sum()
    assert stats.kl_sum == pytest.approx(expected.item())
    assert base_stats.kl_sum == 0.0
    # the loss is a sum over tokens (the trainer divides by the token count): kl_coef * per-token mean * tokens
    assert loss.item() == pytest.approx(base.item() + 0.05 * expected.item(), rel=1e-6)
    assert stats.kl_sum / stats.tokens == pytest.approx((kl[mask.bool()]).mean().item())


def test_policy_loss_without_kl_coef_ignores_the_reference_and_with_it_requires_one():
    batch = _batch()
    plain, _ = policy_loss(batch.old_logprobs, batch, algo=AlgoConfig())
    given, stats = policy_loss(batch.old_logprobs, batch, algo=AlgoConfig(),
                               ref_logprobs=batch.old_logprobs - 1.0)
    assert given.item() == plain.item() and stats.kl_sum == 0.0
    with pytest.raises(AssertionError, match="ref_logprobs"):
        policy_loss(batch.old_logprobs, batch, algo=AlgoConfig(kl_coef=0.1))


def test_kl_gradient_reaches_only_response_tokens():
    batch = _batch()
    logprobs = batch.old_logprobs.clone().requires_grad_()
    ref = batch.old_logprobs - 0.5
    settings = AlgoConfig(kl_coef=1.0)
    loss, _ = policy_loss(logprobs, batch, algo=settings, ref_logprobs=ref)
    base = batch.old_logprobs.clone().requires_grad_()
    policy_loss(base, batch, algo=AlgoConfig())[0].backward()
    loss.backward()
    kl_grad = logprobs.grad - base.grad
    assert (kl_grad[batch.target_mask == 0] == 0).all()
    # logp above the reference on every response token: k3's gradient 1 - e^-0.5 > 0 pushes each one down
    torch.testing.assert_close(kl_grad[batch.target_mask.bool()],
                               torch.full((4,), 1 - math.exp(-0.5)))


def test_kl_keys_default_and_validation():
    cfg = JobConfig()
    assert (cfg.algo.kl_coef, cfg.algo.kl_estimator) == (0.0, "k3")  # off by default
    cfg.algo.kl_coef, cfg.algo.kl_estimator = 0.01, "k2"
    cfg.check()
    cfg.algo.kl_estimator = "k4"
    with pytest.raises(ConfigError, match=r"algo.kl_estimator='k4' is invalid: valid: k1, k2, k3"):
        cfg.check()
    cfg.algo.kl_estimator, cfg.algo.kl_coef = "k3", -0.1
    with pytest.raises(ConfigError, match=r"algo.kl_coef=-0.1 is invalid: must be >= 0"):
        cfg.check()
