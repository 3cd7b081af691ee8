"""Micro-batches (trainer/batching.py): the deal to ranks by tokens, the token budget, the packed layout, and
the packed forward giving each sequence exactly the log-probs it gets alone in a padded row."""

from __future__ import annotations

import pytest
import torch

from colocate.config import ConfigError, ModelConfig, load_config
from colocate.models.sources import ensure_model
from colocate.rl.samples import Sequence
from colocate.trainer.batching import collate, deal, group_micro_batches, micro_batch_tokens, sequence_tokens
from colocate.trainer.logprobs import sequence_logprobs

CPU = torch.device("cpu")


def _seq(prompt: int, response: int, advantage: float = 1.0) -> Sequence:
    return Sequence(list(range(5, 5 + prompt)), list(range(7, 7 + response)), [-1.0 - 0.1 * j for j in range(response)],
                    advantage)


def test_deal_balances_tokens_across_ranks_and_keeps_every_sequence():
    seqs = [_seq(4, n) for n in (60, 3, 3, 3, 30, 28, 2, 1)]
    shares = deal(seqs, 2)
    assert sorted(map(id, seqs)) == sorted(id(s) for share in shares for s in share)
    tokens = [sum(map(sequence_tokens, share)) for share in shares]
    assert abs(tokens[0] - tokens[1]) <= max(map(sequence_tokens, seqs)) // 4, tokens  # round-robin: 97 vs 57
    assert deal(seqs, 2) == shares  # the driver and the ranks deal alike


@pytest.mark.parametrize("packed", [False, True])
def test_a_budget_groups_sequences_under_it(packed):
    seqs = [_seq(2, n) for n in (10, 6, 5, 3, 2, 1, 1)]
    groups = group_micro_batches(seqs, max_seqs=3, max_tokens=14, packed=packed)
    assert sorted(map(id, seqs)) == sorted(id(s) for g in groups for s in g)
    for group in groups:
        assert micro_batch_tokens([sequence_tokens(s) for s in group], packed=packed) <= 14
        assert packed or len(group) <= 3
    fixed = group_micro_batches(seqs, max_seqs=3, max_tokens=None, packed=packed)
    assert [len(g) for g in fixed] == [3, 3, 1]
    lengths = [[sequence_tokens(s) for s in g] for g in groups]  # first-fit decreasing
    assert lengths == ([[12], [8, 5], [7, 4, 3], [3]] if packed else [[12], [8], [7, 5], [4, 3, 3]])
    # packing fills the budget with tokens, not rows: one long answer and short ones take fewer passes
    skewed = [_seq(1, 11)] + [_seq(1, 1) for _ in range(6)]
    assert len(group_micro_batches(skewed, max_seqs=3, max_tokens=14, packed=packed)) == (2 if packed else 3)


def test_packed_layout_restarts_positions_and_never_targets_across_sequences():
    a, b = _seq(2, 3, advantage=0.5), _seq(3, 1, advantage=-1.0)
    batch = collate([a, b], pad_id=0, device=CPU, packed=True)
    assert batch.input_ids.shape == (1, 9) and batch.attention_mask is None
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # a's answer is scored from positions 1..3, b's from 7; position 4 (a's last) predicts b's first: no target
    assert batch.target_mask.tolist() == [[0, 1, 1, 1, 0, 0, 0, 1]]
    assert batch.spans == [(0, 1, 3), (0, 7, 1)]
    assert batch.advantages[0, 1:4].tolist() == [0.5] * 3 and batch.advantages[0, 7] == -1.0
    assert batch.per_sequence(batch.old_logprobs).tolist() == pytest.approx([-3.3, -1.0])
    padded = collate([a, b], pad_id=0, device=CPU)
    assert padded.input_ids.shape == (2, 5) and padded.position_ids is None
    assert padded.per_sequence(padded.old_logprobs).tolist() == pytest.approx([-3.3, -1.0])


def test_packed_logprobs_equal_each_sequence_scored_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_model(ModelConfig(cache_dir=str(tmp_path))),
                                                 dtype=torch.float32)
    seqs = [_seq(3, 5), _seq(6, 2), _seq(2, 9)]
    packed = collate(seqs, pad_id=0, device=CPU, packed=True)
    logprobs, entropy = sequence_logprobs(model, packed, temperature=0.8, top_p=0.9)
    for s, (row, first, num) in zip(seqs, packed.spans):
        alone = collate([s], pad_id=0, device=CPU)
        want, want_entropy = sequence_logprobs(model, alone, temperature=0.8, top_p=0.9)
        torch.testing.assert_close(logprobs[row, first:first + num], want[0, alone.spans[0][1]:][:num],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(entropy[row, first:first + num], want_entropy[0, alone.spans[0][1]:][:num],
                                   rtol=1e-5, atol=1e-6)
    # the control: the same row with positions running on is one long sequence, and the later answers differ
    leaky = collate(seqs, pad_id=0, device=CPU, packed=True)
    leaky.position_ids = torch.arange(leaky.input_ids.shape[1]).unsqueeze(0)
    row, first, num = packed.spans[2]
    assert not torch.allclose(sequence_logprobs(model, leaky, temperature=0.8, top_p=0.9)[0][row, first:first + num],
                              logprobs[row, first:first + num], atol=1e-4)


def test_a_budget_under_the_longest_sequence_is_refused_naming_both_numbers():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.max_tokens_per_micro_batch=100", "engine.max_model_len=128"])
    assert str(e.value).startswith("trainer.max_tokens_per_micro_batch=100 is invalid: the longest sequence this "
                                   "job can train is 128 tokens (engine.max_model_len=128)")
    with pytest.raises(ConfigError, match=r"is 96 tokens \(data.max_prompt_tokens=32 \+ rollout.max_tokens=64\)"):
        load_config(None, ["trainer.max_tokens_per_micro_batch=95", "data.max_prompt_tokens=32",
                           "rollout.max_tokens=64", "engine.max_model_len=128"])
    load_config(None, ["trainer.max_tokens_per_micro_batch=96", "data.max_prompt_tokens=32", "rollout.max_tokens=64",
                       "engine.max_model_len=128"])
    with pytest.raises(ConfigError, match=r"^trainer.max_tokens_per_micro_batch=0 is invalid: must be > 0"):
        load_config(None, ["trainer.max_tokens_per_micro_batch=0"])
