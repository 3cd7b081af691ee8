"""What a training step measures, typed: each trainer rank's sums over its micro-batches, added over the ranks by
the controller, then divided into the step record's per-token figures.

    stats = TrainStats() ; stats += micro_batch_stats      # trainer rank: the loss's own stats, per micro-batch
    total = sum(rank_results, TrainStats())                 # controller: every rank's together
    total.per_token("mismatch_abs_sum")                     # a sum over response tokens / the tokens

Every float field is a sum and adds field by field, and the per-token arrays concatenate: a new statistic is a
field here named `<name>_sum` and its value where the loss computes it (trainer/loss.py policy_loss), nothing
else; the step record (`record`) carries it per token as `<name>`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from colocate.config import AlgoConfig
from colocate.rl.corrections import mismatch_stats


# sums recorded under another name than their own less "_sum" (older records' keys), or inside `correction`
RECORD_NAMES = {"mismatch_abs_sum": "mismatch", "clipped_sum": "clip_fraction",
                "value_clipped_sum": "value_clip_fraction", "return_sum": "return"}
# one value for the whole step: kept, not added
ONE_PER_STEP = ("grad_norm", "lr", "critic_grad_norm", "critic_lr", "value_loss_before", "value_loss_of_zero")
CRITIC_SUMS = ("value_loss_sum", "value_clipped_sum", "value_sum", "return_sum", "return_sq_sum",
               "value_error_sq_sum")
CORRECTION_SUMS = {"corrected_sum": "fraction_affected", "weight_sum": "weight_mean"}


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


@dataclass
class TrainStats:
    tokens: float = 0.0
    """Response tokens trained on."""
    loss_sum: float = 0.0
    """Each response token's loss summed (the surrogate, KL and entropy terms)."""
    objective: float = 0.0
    """The loss as optimised: the token losses summed with the aggregation's weights (trainer/loss.py
    token_scale), which add up over every rank to the step's one number."""
    mismatch_abs_sum: float = 0.0
    """|log p_trainer - log p_engine| summed over response tokens."""
    clipped_sum: float = 0.0
    """Tokens whose ratio the PPO clip cut."""
    corrected_sum: float = 0.0
    """Tokens a TIS/MIS correction truncated or masked."""
    weight_sum: float = 0.0
    """The correction's importance weights summed (tokens, without a correction)."""
    kl_sum: float = 0.0
    """The KL estimator summed over response tokens (0 without a reference)."""
    entropy_sum: float = 0.0
    """The entropy of each response token's sampling distribution (after temperature and top-p), summed."""
    kl_old_sum: float = 0.0
    """algo.old_logprobs=recompute|decoupled: k3 KL of the updated policy to the step's proximal (pre-update) one,
    summed over response tokens; 0 without a recomputed proximal policy."""
    routing_flipped_sum: float = 0.0
    """algo.router_replay: response tokens predicted from a position the trainer's routers would have sent to other
    experts than the engine's, in any layer (the flips the replay removed); 0 without it."""
    value_loss_sum: float = 0.0
    """algo.advantage=gae: the critic's clipped value loss (0.5 x squared error) summed over response tokens."""
    value_clipped_sum: float = 0.0
    """algo.advantage=gae: tokens whose value loss took the clipped term."""
    value_sum: float = 0.0
    """algo.advantage=gae: the critic's values summed over response tokens (as they were trained on)."""
    return_sum: float = 0.0
    """algo.advantage=gae: the returns (the critic's targets) summed over response tokens."""
    return_sq_sum: float = 0.0
    """algo.advantage=gae: the returns squared, summed (the explained variance's denominator)."""
    value_error_sq_sum: float = 0.0
    """algo.advantage=gae: (return - value)^2 summed (the explained variance's numerator)."""
    token_log_w: np.ndarray = field(default_factory=_empty)
    """Every response token's log(p_trainer / p_engine), for the mismatch monitor."""
    seq_log_w: np.ndarray = field(default_factory=_empty)
    """Every sequence's summed log ratio."""
    grad_norm: float | None = None
    """The total gradient norm before clipping (the same on every rank; None without clipping)."""
    lr: float | None = None
    """The step's learning rate (trainer/lr_schedule.py; the same on every rank)."""
    critic_seconds: float = 0.0
    """algo.advantage=gae: seconds the critic's forward, backward and optimizer step took (summed over updates and
    ranks: rank-seconds; bench train --updates reads it on one rank)."""
    critic_grad_norm: float | None = None
    """algo.advantage=gae: the critic's total gradient norm before clipping (None: no critic)."""
    critic_lr: float | None = None
    """algo.advantage=gae: the critic's learning rate this optimizer step."""
    value_loss_before: float | None = None
    """algo.advantage=gae: the critic's loss on the step's returns before the step's first update, 0.5 (V - R)^2 per
    trained token (rl/gae.py value_fit)."""
    value_loss_of_zero: float | None = None
    """algo.advantage=gae: the loss a critic answering 0 (the zero-initialised one) would have there, 0.5 R^2."""
    updates: list = field(default_factory=list)
    """With several optimizer steps a step (algo.num_updates): each one's update_record(), in order."""

    def __add__(self, other: TrainStats) -> TrainStats:
        """Sums add, arrays concatenate, and grad_norm and lr (one value for the whole step) are kept."""
        values = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in ONE_PER_STEP:
                values[f.name] = mine if mine is not None else theirs
            elif isinstance(mine, np.ndarray):
                values[f.name] = np.concatenate([mine, theirs])
            else:
                values[f.name] = mine + theirs
        return TrainStats(**values)

    def update_record(self) -> dict:
        """One optimizer step's figures: its tokens, loss, clip fraction, KL to the step's proximal policy, learning
        rate and gradient norm."""
        record = {"tokens": self.tokens, "loss": self.per_token("loss_sum"), "clip_fraction": self.per_token(
            "clipped_sum"), "kl_old": self.per_token("kl_old_sum"), "lr": self.lr, "grad_norm": self.grad_norm}
        if self.critic_lr is not None:
            record.update(value_loss=self.per_token("value_loss_sum"), critic_grad_norm=self.critic_grad_norm)
        return record

    def critic_record(self) -> dict:
        """The critic's figures (algo.advantage=gae): its loss, clip fraction, mean value and return, and the share
        of the returns' variance its values explain (1 - Var(R - V) / Var(R): 1 perfect, 0 no better than a
        constant, below 0 worse); {} without a critic."""
        if self.critic_lr is None:
            return {}
        figures = {RECORD_NAMES.get(name, name.removesuffix("_sum")): self.per_token(name)
                   for name in CRITIC_SUMS[:4]}
        mean_return = self.per_token("return_sum")
        error = self.per_token("value_error_sq_sum") - (mean_return - self.per_token("value_sum")) ** 2
        variance = self.per_token("return_sq_sum") - mean_return ** 2
        explained = 1 - error / variance if variance > 1e-12 else 0.0
        return {"critic": {**figures, "explained_variance": explained, "grad_norm": self.critic_grad_norm or 0.0,
                           "lr": self.critic_lr, "value_loss_before": self.value_loss_before,
                           "value_loss_of_zero": self.value_loss_of_zero}}

    def per_token(self, name: str) -> float:
        return getattr(self, name) / (self.tokens or 1.0)

    def record(self, algo: AlgoConfig) -> dict:
        """The step record's training figures: every sum per response token, the loss as optimised, the learning
        rate (None: the step trained nothing), the mismatch monitor and the correction's effect."""
        sums = [f.name for f in dataclasses.fields(self) if f.name.endswith("_sum") and f.name not in CRITIC_SUMS]
        record = {RECORD_NAMES.get(name, name.removesuffix("_sum")): self.per_token(name) for name in sums
                  if name not in CORRECTION_SUMS}
        monitor = mismatch_stats(torch.from_numpy(self.token_log_w), torch.from_numpy(self.seq_log_w),
                                 band=algo.mismatch_band)
        correction = {"mode": algo.correction, "level": algo.correction_level,
                      **{key: self.per_token(name) for name, key in CORRECTION_SUMS.items()}}
        return {**record, "objective": self.objective, "lr": self.lr, "mismatch_monitor": monitor,
                "correction": correction, "grad_norm": self.grad_norm or 0.0,
                **self.critic_record(), **({"updates": self.updates} if self.updates else {})}
