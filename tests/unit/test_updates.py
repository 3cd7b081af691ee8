"""A step's policy update (job/updates.py): mini-batches and epochs in a seeded order, the proximal policy scored
before the first update, and the loss under each algo.old_logprobs (trainer/loss.py).

PolicyUpdate's trainers are replaced at the actor boundary by `Trainers`, which records what each optimizer step
was given; the real ranks run it in tests/e2e/test_algorithms.py."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from colocate.config import AlgoConfig, JobConfig, RolloutConfig
from colocate.job.updates import PolicyUpdate, mini_batches
from colocate.rl.samples import Sequence
from colocate.trainer.loss import collate, policy_loss
from colocate.trainer.stats import TrainStats

SEQS = [Sequence([1, 2], [3 + i % 5] * (1 + i % 3), [-1.0 - 0.1 * i] * (1 + i % 3), float(i % 2)) for i in range(12)]


def test_n_mini_batches_times_e_epochs_in_the_seeded_order():
    batches = mini_batches(list(range(12)), num_mini_batches=3, num_epochs=2, seed=7, step=4)
    assert len(batches) == 6 and all(len(b) == 4 for b in batches)
    for epoch in range(2):
        order = list(range(12))
        random.Random(f"7/4/{epoch}").shuffle(order)
        assert sum(batches[3 * epoch:3 * epoch + 3], []) == order  # every sequence once an epoch, in that order
    assert sum(batches[:3], []) != sum(batches[3:], [])  # each epoch its own order
    # a resumed run: the same step's order again, from nothing but the seed and the step
    assert mini_batches(list(range(12)), num_mini_batches=3, num_epochs=2, seed=7, step=4) == batches
    assert mini_batches(list(range(12)), num_mini_batches=3, num_epochs=2, seed=7, step=5) != batches
    # a step that lost sequences (dynamic sampling, masking) is cut as evenly as it can be
    assert [len(b) for b in mini_batches(list(range(10)), num_mini_batches=3, num_epochs=1, seed=0, step=0)] == \
        [4, 3, 3]
    assert mini_batches(list(range(5)), num_mini_batches=1, num_epochs=1, seed=0, step=0) == [list(range(5))]


class Trainers:
    """What PolicyUpdate asks of the ranks: scores (the proximal policy), and one optimizer step per call."""

    def __init__(self):
        self.calls = []

    def score(self, sequences, cfg, *, temperature, top_p):
        self.calls.append(("score", [s.logprobs for s in sequences]))
        return [[lp + 0.5 for lp in s.logprobs] for s in sequences]

    def train_step(self, sequences, cfg, *, step, update):
        self.calls.append(("train", update, sequences))
        return TrainStats(tokens=float(sum(len(s.response_ids) for s in sequences)), loss_sum=1.0,
                          lr=0.1 * (update + 1), token_log_w=np.ones(3, np.float32))


def job(**algo) -> JobConfig:
    return JobConfig(algo=AlgoConfig(**algo), rollout=RolloutConfig(num_prompts=6, num_samples=2, seed=3))


@pytest.mark.parametrize("old, recomputes", [("recompute", True), ("decoupled", True), ("engine", False)])
def test_the_proximal_policy_is_scored_once_before_the_first_update(old, recomputes):
    updates = {"num_mini_batches": 2, "num_epochs": 2} if old != "engine" else {}
    correction = {"correction": "tis"} if old == "decoupled" else {}
    trainers = Trainers()
    update = PolicyUpdate(SimpleNamespace(trainers=trainers), job(old_logprobs=old, **updates, **correction))
    total = update.run(SEQS, step=2)
    kinds = [c[0] for c in trainers.calls]
    assert kinds == (["score"] if recomputes else []) + ["train"] * (4 if updates else 1)
    trained = [c for c in trainers.calls if c[0] == "train"]
    assert [c[1] for c in trained] == list(range(len(trained)))  # the update index: the schedule's count
    for _, _, seqs in trained:
        for s in seqs:
            assert s.old_logprobs == ([lp + 0.5 for lp in s.logprobs] if recomputes else None)
    if updates:
        assert [u["lr"] for u in total.updates] == pytest.approx([0.1, 0.2, 0.3, 0.4])
        assert len(total.token_log_w) == 3 * 2  # the monitor counts the first epoch's tokens only
    else:
        assert total.updates == []


def test_decoupled_with_one_optimizer_step_needs_no_pass():
    trainers = Trainers()
    PolicyUpdate(SimpleNamespace(trainers=trainers), job(old_logprobs="decoupled", correction="mis")).run(SEQS, step=0)
    assert [c[0] for c in trainers.calls] == ["train"]


def batch_and_logprobs(prox: bool):
    seqs = [Sequence([1], [2, 3], [-1.0, -2.5], 1.0), Sequence([1, 4], [5], [-0.7], -1.0)]
    new = [[-1.2, -2.0], [-0.4]]
    if prox:
        seqs = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(seqs, new)]
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))
    logprobs = torch.zeros_like(batch.old_logprobs)
    for (row, first, num), lp in zip(batch.spans, new):
        logprobs[row, first:first + num] = torch.tensor(lp)
    return batch, logprobs.requires_grad_()


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("prox", [False, True])
def test_decoupled_with_one_optimizer_step_is_todays_corrected_loss(correction, prox):
    # the proximal policy is the one before the update: with one update, the forward's own (detached) log-probs,
    # whether recomputed (same values) or not; then decoupled is engine + the correction, bit for bit
    batch, logprobs = batch_and_logprobs(prox=False)
    today, today_stats = policy_loss(logprobs, batch, algo=AlgoConfig(correction=correction, tis_cap=1.5))
    today.backward()
    grad = logprobs.grad.clone()
    batch, logprobs = batch_and_logprobs(prox=prox)
    loss, stats = policy_loss(logprobs, batch, algo=AlgoConfig(correction=correction, tis_cap=1.5,
                                                               old_logprobs="decoupled"))
    loss.backward()
    assert torch.equal(loss, today) and torch.equal(logprobs.grad, grad)
    assert stats.weight_sum == today_stats.weight_sum and stats.mismatch_abs_sum == today_stats.mismatch_abs_sum


def test_recompute_anchors_the_ratio_at_the_proximal_policy():
    batch, logprobs = batch_and_logprobs(prox=True)
    moved = (logprobs.detach() + 0.1).requires_grad_()  # an update later: the policy moved by 0.1 in log space
    loss, stats = policy_loss(moved, batch, algo=AlgoConfig(old_logprobs="recompute", clip_eps=0.5))
    mask = batch.target_mask
    expected = -(torch.exp(torch.tensor(0.1)) * batch.advantages * mask).sum()
    torch.testing.assert_close(loss, expected)
    assert stats.kl_old_sum == pytest.approx(3 * (np.exp(-0.1) - 1 + 0.1), rel=1e-5)  # k3 of the 0.1 move
    # the monitor still compares the proximal policy with the engine, not the moved one
    assert stats.mismatch_abs_sum == pytest.approx(0.2 + 0.5 + 0.3, rel=1e-5)


@pytest.mark.parametrize("overrides, key", [
    ({"num_mini_batches": 2}, "algo.old_logprobs"),
    ({"num_epochs": 2}, "algo.old_logprobs"),
    ({"old_logprobs": "recompute", "correction": "tis"}, "algo.old_logprobs"),
    ({"old_logprobs": "decoupled"}, "algo.old_logprobs"),
    ({"num_mini_batches": 0}, "algo.num_mini_batches"),
])
def test_bad_update_settings_are_one_line_naming_the_key(overrides, key):
    from colocate.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        AlgoConfig(**overrides).check()


def test_mini_batches_must_divide_the_steps_sequences():
    from colocate.errors import ConfigError

    cfg = job(num_mini_batches=5, old_logprobs="recompute")  # 6 prompts x 2 samples = 12
    with pytest.raises(ConfigError, match=r"algo.num_mini_batches=5 is invalid: must divide the step's 12 .* e.g. 4"):
        cfg.check()


def test_the_rollout_dump_is_bounded_and_a_resume_cuts_the_steps_it_trains_again(tmp_path):
    from colocate.config import LoggingConfig
    from colocate.job.rollout_dump import RolloutDump, read_rollouts
    from colocate.rl.samples import Answer, Group
    from colocate.rl.scoring import Scored, ScoredGroup
    from colocate.rl.tasks import Sample

    groups = [ScoredGroup(Group(Sample(f"p{g}", "a"), [1, 2], [Answer(0, 8, token_ids=[3, 4], logprobs=[-1.0, -2.0])
                                                               for _ in range(2)]), [1.0, 0.0], ["x", "y"])
              for g in range(3)]
    scored = Scored.from_groups(groups, algo=AlgoConfig())
    cfg = job()
    dump = RolloutDump(LoggingConfig(output_dir=str(tmp_path), rollouts=2, rollouts_max_mb=1.0))
    trainers = Trainers()
    for step in range(3):
        dump.write(step, scored, scored.sequences, trainers, cfg)
    lines = read_rollouts(tmp_path / "rollouts.jsonl")
    assert [(line["step"], line["group"], line["answer"]) for line in lines] == [
        (s, g, a) for s in range(3) for g in range(2) for a in range(2)]  # the first two groups, each answer
    assert lines[0]["prompt"] == "p0" and lines[0]["trainer_logprobs"] == [-0.5, -1.5]  # Trainers' scores
    assert lines[1]["advantage"] == scored.sequences[1].advantage and lines[1]["response"] == "y"
    dump.resume(after_step=0)  # a checkpoint after step 0: steps 1 and 2 are trained again
    assert {line["step"] for line in read_rollouts(tmp_path / "rollouts.jsonl")} == {0}
    tiny = RolloutDump(LoggingConfig(output_dir=str(tmp_path / "tiny"), rollouts=-1, rollouts_max_mb=1e-4))
    for step in range(3):
        tiny.write(step, scored, scored.sequences, trainers, cfg)
    lines = read_rollouts(tmp_path / "tiny" / "rollouts.jsonl")
    assert lines[-1]["event"] == "rollouts_stopped" and {line.get("step") for line in lines} == {0}
    assert len(lines) == 6 + 1  # every group of step 0, then the line that says it stopped
