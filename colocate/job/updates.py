"""A step's policy update: its sequences in mini-batches and epochs, each mini-batch one optimizer step, and the
proximal policy the ratio is anchored at (algo.num_mini_batches, algo.num_epochs, algo.old_logprobs).

    update = PolicyUpdate(runtime, cfg)       # its trainers (job/groups.py TrainerGroup), read when it runs
    total = update.run(sequences, step=3)      # num_mini_batches x num_epochs optimizer steps; one TrainStats

With more than one optimizer step a step, the ratio's denominator cannot stay the engine's sampling policy:
after the first update the trainer's policy has moved. `recompute` and `decoupled` therefore score every sequence
with the trainer before the first update (one forward pass, no gradient: TrainerGroup.score) and put it in each
Sequence's `old_logprobs`; the loss anchors the clip there (trainer/loss.py). With one optimizer step, `decoupled`
needs no pass (the forward's own log-probs, detached, are that policy) and is today's corrected loss.

algo.advantage=gae: the critic scores every sequence before the first update too (TrainerGroup.values), and
rl/gae.py turns each answer's reward into per-token advantages and returns; every mini-batch then steps the policy
and the critic (trainer/critic.py), the critic's value clipping anchored at these values.

The shuffle is a function of (rollout.seed, step, epoch) and of the sequences' order, which the controller makes
deterministic: a run resumed from a checkpoint shuffles its steps as the uninterrupted one did, with no state.
"""

from __future__ import annotations

import dataclasses
import random

from colocate.config import JobConfig
from colocate.rl.gae import value_fit, with_gae
from colocate.rl.samples import Sequence
from colocate.trainer.stats import TrainStats


def mini_batches(sequences: list, *, num_mini_batches: int, num_epochs: int, seed: int,
                 step: int) -> list[list]:
    """Every optimizer step's sequences, in order: per epoch a seeded shuffle, cut into `num_mini_batches`
    contiguous parts whose sizes differ by at most one (the config divides the full step evenly; a step that lost
    sequences, to dynamic sampling or masking, is cut as evenly as it can be)."""
    if num_mini_batches == num_epochs == 1:
        return [list(sequences)]  # one optimizer step: the order changes nothing, and stays the one it was given
    out = []
    for epoch in range(num_epochs):
        order = list(range(len(sequences)))
        random.Random(f"{seed}/{step}/{epoch}").shuffle(order)
        size, extra = divmod(len(order), num_mini_batches)
        start = 0
        for k in range(num_mini_batches):
            end = start + size + (k < extra)
            if end > start:
                out.append([sequences[i] for i in order[start:end]])
            start = end
    return out


class PolicyUpdate:
    def __init__(self, runtime, cfg: JobConfig) -> None:
        self.runtime, self.cfg, self.algo = runtime, cfg, cfg.algo

    @property
    def trainers(self):
        return self.runtime.trainers

    def run(self, sequences: list[Sequence], *, step: int) -> TrainStats:
        """The step's update: prepare, then train."""
        return self.train(self.prepare(sequences), step=step)

    def prepare(self, sequences: list[Sequence]) -> list[Sequence]:
        """What every update reads, computed once before the first: the proximal policy's log-probs
        (algo.old_logprobs), and with algo.advantage=gae the critic's values, per-token advantages and returns.
        The sequences in the order given (the rollout dump reads them as trained)."""
        if not sequences:
            return []
        if self.algo.recomputes_proximal:
            rollout = self.cfg.rollout
            proximal = self.trainers.score(sequences, self.cfg.trainer, temperature=rollout.temperature,
                                           top_p=rollout.top_p)
            sequences = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(sequences, proximal)]
        if self.algo.advantage == "gae":  # the critic's values before any update: GAE's, and value clipping's anchor
            values = self.trainers.values(sequences, self.cfg.trainer)
            sequences = with_gae(sequences, values, gamma=self.algo.gamma, lam=self.algo.lam)
        return sequences

    def train(self, sequences: list[Sequence], *, step: int) -> TrainStats:
        """num_mini_batches x num_epochs optimizer steps on prepared sequences; their stats added up."""
        if not sequences:
            return TrainStats()
        batches = mini_batches(sequences, num_mini_batches=self.algo.num_mini_batches,
                               num_epochs=self.algo.num_epochs, seed=self.cfg.rollout.seed, step=step)
        total, updates = TrainStats(), []
        if self.algo.advantage == "gae":
            total.value_loss_before, total.value_loss_of_zero = value_fit(sequences)
        for k, batch in enumerate(batches):
            part = self.trainers.train_step(batch, self.cfg.trainer, step=step, update=k)
            updates.append(part.update_record())
            if k >= self.algo.num_mini_batches:  # a later epoch: its tokens are in the monitor once already
                part = dataclasses.replace(part, token_log_w=TrainStats().token_log_w,
                                           seq_log_w=TrainStats().seq_log_w)
            total += part
        if len(batches) > 1:
            total.updates = updates
        return total
