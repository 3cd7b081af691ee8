"""The mismatch monitor and the TIS / MIS corrections against their formulas, on hand-built tensors; and the
trainer's logprobs under the engine's sampling (temperature, nucleus), as vLLM's processed logprobs define it."""

from __future__ import annotations

import math

import pytest
import torch

from colocate.config import AlgoConfig
from colocate.rl.corrections import importance_weights, mismatch_stats
from colocate.trainer.logprobs import LOGPROB_FLOOR, token_logprobs
from colocate.trainer.loss import Sequence, collate, policy_loss

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# log w = logp_trainer - logp_engine per token; the padding position carries garbage that must not count
LOG_W = torch.log(torch.tensor([[1.0, 3.0, 0.25], [1.5, 0.8, 100.0]]))


@pytest.mark.parametrize("mode, level, weights, affected", [
    pytest.param("tis", "token", [[1.0, 2.0, 0.25], [1.5, 0.8, 0.0]], [[0, 1, 0], [0, 0, 0]], id="tis_token"),
    # sequence weights: 1 * 3 * 0.25 = 0.75 (kept), 1.5 * 0.8 = 1.2 (kept)
    pytest.param("tis", "sequence", [[0.75] * 3, [1.2, 1.2, 0.0]], [[0, 0, 0], [0, 0, 0]], id="tis_sequence"),
    pytest.param("mis", "token", [[1.0, 0.0, 0.0], [1.5, 0.8, 0.0]], [[0, 1, 1], [0, 0, 0]], id="mis_token"),
    pytest.param("mis", "sequence", [[0.75] * 3, [1.2, 1.2, 0.0]], [[0, 0, 0], [0, 0, 0]], id="mis_sequence"),
])
def test_importance_weights(mode, level, weights, affected):
    got, changed = importance_weights(LOG_W, MASK, mode=mode, level=level, cap=2.0, low=0.5, high=2.0)
    assert torch.allclose(got, torch.tensor(weights))
    assert changed.tolist() == affected


def test_sequence_level_mis_drops_a_whole_sequence():
    log_w = torch.log(torch.tensor([[3.0, 1.0, 1.0]]))  # product 3: outside [0.5, 2]
    got, changed = importance_weights(log_w, torch.ones(1, 3), mode="mis", level="sequence", cap=2, low=0.5, high=2)
    assert got.tolist() == [[0.0, 0.0, 0.0]] and changed.tolist() == [[1.0, 1.0, 1.0]]


def test_mismatch_stats():
    tokens = torch.log(torch.tensor([1.0, 1.05, 0.8, 1.2, 1.0]))
    stats = mismatch_stats(tokens, tokens[:2], band=1.1)
    token = stats["token"]
    assert token["count"] == 5
    assert token["mean_abs_log_ratio"] == pytest.approx(float(tokens.abs().mean()))
    assert token["max_abs_log_ratio"] == pytest.approx(math.log(1 / 0.8))
    assert token["fraction_outside_band"] == pytest.approx(2 / 5)  # 0.8 and 1.2 lie outside [1/1.1, 1.1]
    assert token["ratio_min"] == pytest.approx(0.8) and token["ratio_max"] == pytest.approx(1.2)
    assert token["ratio_quantiles"]["p50"] == pytest.approx(1.0)
    assert stats["sequence"]["count"] == 2 and stats["sequence"]["fraction_outside_band"] == 0.0


def _loss_and_grad(settings: AlgoConfig, engine_logprobs: list[float], trainer_logprobs: list[float]):
    batch = collate([Sequence([1], [2, 3], engine_logprobs, 1.0)], pad_id=0, device=torch.device("cpu"))
    logprobs = torch.zeros_like(batch.old_logprobs)
    logprobs[0, :2] = torch.tensor(trainer_logprobs)
    logprobs.requires_grad_()
    loss, stats = policy_loss(logprobs, batch, algo=settings)
    loss.backward()
    return loss.item(), logprobs.grad[0, :2].tolist(), stats


def test_tis_weights_the_on_policy_gradient_by_the_truncated_ratio():
    # w = exp(trainer - engine) = [e^2 (truncated to 2), e^-0.5]
    loss, grad, stats = _loss_and_grad(AlgoConfig(correction="tis", tis_cap=2.0), [-3.0, -1.0], [-1.0, -1.5])
    weights = [2.0, math.exp(-0.5)]
    assert loss == pytest.approx(-sum(weights))  # ratio 1 in value, advantage 1
    assert grad == pytest.approx([-w for w in weights])  # d(-w * exp(l - sg(l)))/dl = -w
    assert stats.corrected_sum == 1.0 and stats.weight_sum == pytest.approx(sum(weights))
    assert stats.token_log_w.tolist() == pytest.approx([2.0, -0.5])


def test_mis_drops_tokens_outside_the_band():
    loss, grad, stats = _loss_and_grad(AlgoConfig(correction="mis", mis_low=0.5, mis_high=2.0), [-3.0, -1.0],
                                       [-1.0, -1.5])
    assert grad == pytest.approx([0.0, -math.exp(-0.5)])  # e^2 lies outside [0.5, 2]: no gradient
    assert stats.corrected_sum == 1.0


def test_no_correction_keeps_the_ratio_against_the_engine():
    loss, grad, _ = _loss_and_grad(AlgoConfig(correction="none", clip_eps=10.0), [-1.0, -1.0], [-0.5, -1.0])
    assert grad == pytest.approx([-math.exp(0.5), -1.0])  # d(-exp(l - l_engine))/dl


def _nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The engine's sampling distribution for one position, written out by hand."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    kept, mass = [], 0.0
    for index in order.tolist():  # smallest set of most likely tokens whose mass reaches top_p
        kept.append(index)
        mass += float(probs[index])
        if mass >= top_p - 1e-9:
            break
    out = torch.full_like(probs, float("-inf"))
    out[kept] = torch.log(probs[kept] / probs[kept].sum())
    return out


@pytest.mark.parametrize("temperature, top_p", [
    pytest.param(1.0, 1.0, id="plain"), pytest.param(0.7, 1.0, id="temperature"),
    pytest.param(1.0, 0.8, id="top_p"), pytest.param(1.3, 0.6, id="both"),
])
def test_token_logprobs_follow_the_sampling_distribution(temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 11)
    ranked = logits[0].argsort(dim=-1, descending=True)
    # targets: the most likely token, the second, and an unlikely one (outside any nucleus of small mass)
    ids = torch.tensor([[0, int(ranked[0, 0]), int(ranked[1, 1]), int(ranked[2, -1])]])
    got = token_logprobs(logits, ids, temperature=temperature, top_p=top_p)
    for t in range(3):
        expected = _nucleus_logprobs(logits[0, t], temperature, top_p)[ids[0, t + 1]]
        if math.isinf(expected.item()):  # outside the nucleus: the floor, finite
            assert got[0, t].item() == LOGPROB_FLOOR
        else:
            assert got[0, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_nucleus_keeps_the_loss_finite_at_padding_and_outside_tokens():
    torch.manual_seed(1)
    seqs = [Sequence([1], [2, 3], [-0.5, -0.7], 1.0), Sequence([1], [4], [-0.2], -1.0)]  # second row is padded
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))
    logits = torch.randn(2, batch.input_ids.shape[1], 8, requires_grad=True)
    logprobs = token_logprobs(logits, batch.input_ids, temperature=0.9, top_p=0.3)
    for correction in ("none", "tis", "mis"):
        loss, _ = policy_loss(logprobs, batch, algo=AlgoConfig(correction=correction))
        (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), correction
