"""REINFORCE++'s token returns with the KL folded in (algo.advantage=reinforce_pp, algo.kl_in_reward), normalised
over every rank's response tokens.

    returns = kl_returns(batch, ref_logprobs, kl_coef=0.01, estimator="k1")   # per micro-batch, [rows, T-1]
    advantages = whiten_over_ranks(all_returns, all_masks)                    # one all-reduce for the step

Hu 2025 (REINFORCE++), with gamma = 1 and an outcome reward r_i given at the answer's end: token t's return is
    R_t = r_i - kl_coef x sum_{s >= t} KL_s,        KL_s = the estimator of log(pi_behaviour / pi_ref) at s,
and the advantage is R_t normalised by the mean and std of every R_t of the step (all ranks, all micro-batches).
The KL is that of the policy that sampled the tokens (the engine's logprobs) against the frozen reference,
fixed for the step as a reward is: it carries no gradient. This lives in the trainer because only it holds the
reference's logprobs; the driver passes each sample's raw reward as its advantage (rl/advantages.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colocate.rl.advantages import EPS
from colocate.trainer.batching import MicroBatch
from colocate.trainer.loss import KL_CLAMP, kl_estimator


def kl_returns(batch: MicroBatch, ref_logprobs: torch.Tensor, *, kl_coef: float, estimator: str) -> torch.Tensor:
    """[rows, T-1] each response token's return: its sequence's reward (batch.advantages) minus kl_coef x the KL
    summed from that token to the answer's end; zero off the mask."""
    # Hazard: a token outside the reference's nucleus has its floored logprob (-100): k1 would be ~100 there, and
    # summed over the suffix it would swamp every return; each token's KL is bounded as k3's log ratio is
    kl = kl_estimator(batch.old_logprobs, ref_logprobs, estimator).clamp(-KL_CLAMP, KL_CLAMP) * batch.target_mask
    suffix = torch.zeros_like(kl)
    for row, first, num in batch.spans:  # per sequence: a packed row holds several, and a suffix stops at its end
        suffix[row, first:first + num] = kl[row, first:first + num].flip(0).cumsum(0).flip(0)
    return (batch.advantages - kl_coef * suffix) * batch.target_mask


def whiten_over_ranks(returns: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """(R - mean) / (std + eps) with the mean and (population) std of every masked R on every rank: one
    all-reduce of (count, sum, sum of squares) when a process group is up. A collective: every rank calls it."""
    # on the tensors' device: NCCL reduces CUDA tensors only
    moments = torch.zeros(3, dtype=torch.float64, device=returns[0].device)
    for r, m in zip(returns, masks):
        r, m = r.double(), m.double()  # E[r^2] - E[r]^2 cancels: fp32 sums would lose the variance
        moments += torch.stack([m.sum(), (r * m).sum(), (r * r * m).sum()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(moments)
    count, total, squares = moments.tolist()
    mean = total / max(count, 1.0)
    std = max(squares / max(count, 1.0) - mean * mean, 0.0) ** 0.5
    return [(r - mean) / (std + EPS) * m for r, m in zip(returns, masks)]
