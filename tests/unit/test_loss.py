"""GRPO loss pieces: sequence alignment, the clipped surrogate, group advantages, reward errors."""

from __future__ import annotations

import math

import pytest
import torch

from colocate.config import AlgoConfig
from colocate.errors import RewardError
from colocate.rl.samples import Answer, Group
from colocate.rl.scoring import score
from colocate.rl.tasks import Sample
from colocate.trainer.logprobs import token_logprobs
from colocate.trainer.loss import Sequence, collate, policy_loss


def test_collate_aligns_targets_with_response_tokens():
    seqs = [Sequence([5, 6], [7, 8, 2], [-1.0, -2.0, -3.0], 0.5), Sequence([5], [9], [-0.5], -1.0)]
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 2], [5, 9, 0, 0, 0]]
    # logits at position t predict token t+1: response token 7 (position 2) is scored at target index 1
    assert batch.target_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0, -1.0, -2.0, -3.0], [-0.5, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_token_logprobs_gathers_the_next_token():
    logits = torch.log(torch.tensor([[[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]]]))
    ids = torch.tensor([[0, 1, 0]])
    assert torch.allclose(token_logprobs(logits, ids), torch.log(torch.tensor([[0.3, 0.2]])))


def test_on_policy_loss_is_minus_advantage_per_token():
    seqs = [Sequence([1], [2, 3], [-1.0, -1.0], 2.0)]
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))
    logprobs = batch.old_logprobs.clone().requires_grad_()
    loss, stats = policy_loss(logprobs, batch, algo=AlgoConfig(clip_eps=0.2))
    assert loss.item() == pytest.approx(-4.0)  # two tokens, ratio 1, advantage 2
    assert stats.tokens == 2 and stats.mismatch_abs_sum == 0 and stats.clipped_sum == 0


def test_ratio_is_clipped_for_positive_advantage():
    seqs = [Sequence([1], [2], [math.log(0.5)], 1.0)]
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))
    new = torch.tensor([[math.log(0.9)]])  # ratio 1.8 > 1.2
    loss, stats = policy_loss(new, batch, algo=AlgoConfig(clip_eps=0.2))
    assert loss.item() == pytest.approx(-1.2)
    assert stats.clipped_sum == 1
    assert stats.mismatch_abs_sum == pytest.approx(math.log(1.8))


def _rollout(tokens_list):
    completions = [Answer(seed=0, max_tokens=8, token_ids=t, logprobs=[-1.0] * len(t), finish_reason="stop")
                   for t in tokens_list]
    return Group(Sample("12=", "12"), [1, 2, 3], completions)


def test_score_strips_eos_from_text_but_trains_on_it():
    decode = lambda ids: "".join(str(i) for i in ids)  # noqa: E731
    scored = score([_rollout([[1, 2, 99], [1, 99]])], reward_fn=lambda p, r, a: float(r == a), decode=decode,
                   eos_id=99, algo=AlgoConfig(advantage="dr_grpo"))
    assert scored.responses == ["12", "1"]
    assert scored.rewards == [1.0, 0.0]
    assert scored.sequences[0].response_ids == [1, 2, 99]
    assert scored.sequences[0].advantage == 0.5


def test_reward_error_names_prompt_and_response():
    def broken(prompt, response, answer):
        raise KeyError("boom")

    with pytest.raises(RewardError, match=r"prompt '12=', response '7'"):
        score([_rollout([[7]])], reward_fn=broken, decode=lambda ids: "7", eos_id=None, algo=AlgoConfig())
