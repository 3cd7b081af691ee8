"""Generalised advantage estimation (algo.advantage=gae: Schulman et al. 2016, as PPO runs it on LLM answers).

    values = trainers.values(sequences)                          # the critic's V of every response token
    adv, ret = gae(reward=r, values=v, trained=m, gamma=1.0, lam=0.95)   # one sequence
    adv = whiten([a for a in advs], [m for m in masks])          # over every trained token of the step

The trajectory is a sequence's trained tokens in order: response token t is the action taken in state s_t (the
prompt and the tokens before it), and V_t = V(s_t) is the critic's output at the position whose logits predict
token t (trainer/critic.py). The reward is the answer's, given at its last trained token; every other token's is 0,
and the state after the last token is terminal (V = 0: an answer cut at rollout.max_tokens is treated as ended, as
verl and OpenRLHF treat it). Then, from the last token back,

    delta_t = r_t + gamma V_{t+1} - V_t,        A_t = delta_t + gamma lam A_{t+1},        R_t = A_t + V_t

R_t is the critic's regression target. Multi-turn: an environment's observation tokens are no action. They are
skipped, so the token after an observation bootstraps from the first token of the next turn (each turn's tokens
keep values of their own), and they get advantage 0 and no value loss, as verl's multi-turn GAE does.
The advantages are then whitened over every trained token of the step (verl's masked_whiten); the returns are not.
"""

from __future__ import annotations

import dataclasses
import math


def gae(*, reward: float, values: list[float], trained: list[int] | None, gamma: float,
        lam: float) -> tuple[list[float], list[float]]:
    """One sequence's per-token advantages and returns (lists as long as `values`, 0 off `trained`). `reward`: the
    answer's reward, given at its last trained token. `trained`: 1 per token trained (None: all)."""
    mask = trained if trained is not None else [1] * len(values)
    assert len(mask) == len(values), (len(mask), len(values))
    advantages, returns = [0.0] * len(values), [0.0] * len(values)
    next_value, next_advantage, last = 0.0, 0.0, True
    for t in range(len(values) - 1, -1, -1):
        if not mask[t]:
            continue
        gain = reward if last else 0.0
        delta = gain + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t], returns[t] = next_advantage, next_advantage + values[t]
        next_value, last = values[t], False
    return advantages, returns


def whiten(advantages: list[list[float]], masks: list[list[int] | None], *, eps: float = 1e-8) -> list[list[float]]:
    """(A - mean) / (std + eps) with the mean and population std of every trained token's A; 0 off the masks."""
    flat = [a for adv, m in zip(advantages, masks) for a, on in zip(adv, m or [1] * len(adv)) if on]
    if not flat:
        return [list(a) for a in advantages]
    mean = math.fsum(flat) / len(flat)
    std = math.sqrt(math.fsum((a - mean) ** 2 for a in flat) / len(flat))
    return [[(a - mean) / (std + eps) if on else 0.0 for a, on in zip(adv, m or [1] * len(adv))]
            for adv, m in zip(advantages, masks)]


def with_gae(sequences: list, values: list[list[float]], *, gamma: float, lam: float) -> list:
    """The step's Sequences (rl/samples.py; `advantage` holds each answer's reward, rl/advantages.py) with per-token
    advantages (whitened over the step), returns and the values they came from."""
    masks = [s.mask for s in sequences]
    estimated = [gae(reward=s.advantage, values=v, trained=s.mask, gamma=gamma, lam=lam)
                 for s, v in zip(sequences, values)]
    advantages = whiten([a for a, _ in estimated], masks)
    return [dataclasses.replace(s, token_advantages=a, returns=r, old_values=list(v))
            for s, a, (_, r), v in zip(sequences, advantages, estimated, values)]


def value_fit(sequences: list) -> tuple[float, float]:
    """Per trained token, the critic's loss on the step's returns before its update, 0.5 (V - R)^2, and the loss a
    critic answering 0 everywhere (the zero-initialised head's) would have, 0.5 R^2: the first falling below the
    second is the critic learning. Sequences as with_gae returns them."""
    before, zero, count = 0.0, 0.0, 0
    for s in sequences:
        for value, ret, on in zip(s.old_values, s.returns, s.mask or [1] * len(s.returns)):
            if on:
                before, zero, count = before + 0.5 * (value - ret) ** 2, zero + 0.5 * ret ** 2, count + 1
    return before / max(count, 1), zero / max(count, 1)
