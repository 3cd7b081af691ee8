"""Advantage estimators (`algo.advantage`): each sample's reward turned into how much its tokens should be pushed up.

    advantages = estimate_advantages(rewards_per_group, estimator="grpo", num_tokens_per_group=...)

Every estimator but REINFORCE++ takes its baseline from the prompt's own group of `rollout.num_samples` answers
(a group of one would always give 0: JobConfig.check refuses it). With r_i the rewards of a group of n:

    grpo          (r_i - mean(r)) / (std(r) + eps)          DeepSeekMath (Shao et al. 2024); std over the group
    dr_grpo       r_i - mean(r)                             Dr. GRPO (Liu et al. 2025): no std, no difficulty bias
    rloo          r_i - mean(r_j, j != i)                   RLOO (Ahmadian et al. 2024) = n/(n-1) (r_i - mean(r))
    reinforce_pp  (r_i - mu) / (sigma + eps)                REINFORCE++ (Hu 2025): mu, sigma over every response
                                                            *token* of the step (each sample's reward counted once
                                                            per token, as its tokens' returns are)

gae (PPO with a critic) is per token and needs the critic's values: this passes each sample's raw reward on, and
job/updates.py turns it into per-token advantages (rl/gae.py) before the step's first update.

A group whose rewards are all equal gets 0 everywhere (its std is 0: eps keeps the division finite). With
`algo.kl_in_reward` REINFORCE++'s returns hold a per-token KL term that only the trainer can compute (it needs the
reference's logprobs): the driver then passes each sample's raw reward, and trainer/token_returns.py folds the KL
in and normalises over all ranks' tokens there.
"""

from __future__ import annotations

import math

EPS = 1e-6  # a uniform group's std is 0: (r - mean) / (0 + eps) = 0, no NaN


def estimate_advantages(rewards: list[list[float]], *, estimator: str,
                        num_tokens: list[list[int]] | None = None, kl_in_reward: bool = False) -> list[list[float]]:
    """Each sample's advantage, groups as given. `num_tokens` (each sample's response tokens) weighs
    REINFORCE++'s batch statistics; with `kl_in_reward` the raw rewards are returned for the trainer to shape."""
    if estimator == "grpo":
        return [_group(g, divide_by_std=True) for g in rewards]
    if estimator == "dr_grpo":
        return [_group(g, divide_by_std=False) for g in rewards]
    if estimator == "rloo":
        return [_leave_one_out(g) for g in rewards]
    if estimator == "gae":  # per token, against the critic's values: job/updates.py (rl/gae.py) estimates it
        return [list(g) for g in rewards]
    assert estimator == "reinforce_pp", estimator
    if kl_in_reward:
        return [list(g) for g in rewards]
    assert num_tokens is not None, "REINFORCE++ weighs its batch statistics by tokens"
    mean, std = token_weighted_moments(rewards, num_tokens)
    return [[(r - mean) / (std + EPS) for r in g] for g in rewards]


def _group(rewards: list[float], *, divide_by_std: bool) -> list[float]:
    mean = math.fsum(rewards) / len(rewards)
    if not divide_by_std:
        return [r - mean for r in rewards]
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))  # the population std
    return [(r - mean) / (std + EPS) for r in rewards]


def _leave_one_out(rewards: list[float]) -> list[float]:
    n, total = len(rewards), math.fsum(rewards)
    assert n >= 2, "a leave-one-out baseline needs another sample"
    return [r - (total - r) / (n - 1) for r in rewards]


def token_weighted_moments(rewards: list[list[float]], num_tokens: list[list[int]]) -> tuple[float, float]:
    """Mean and (population) std of the rewards with each sample counted once per response token."""
    pairs = [(r, n) for g, t in zip(rewards, num_tokens) for r, n in zip(g, t)]
    weight = sum(n for _, n in pairs)
    if weight == 0:
        return 0.0, 0.0
    mean = math.fsum(r * n for r, n in pairs) / weight
    return mean, math.sqrt(math.fsum(n * (r - mean) ** 2 for r, n in pairs) / weight)
