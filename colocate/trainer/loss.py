"""The policy loss on sampled sequences, with the engine's sampling logprobs as the behaviour policy.

Every tensor is per target position of a micro-batch (trainer/batching.py: padded or packed, the same here).
docs/algorithms.md gives each choice's formula and paper. Per response token t of sequence i, with
r_t = exp(logp_trainer - logp_engine) and the advantage A_i (rl/advantages.py):

    ppo    -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)        (+ dual clip: at most -c A where A < 0)
    gspo   the same with one ratio per sequence, s_i = exp(mean_t log r_t) (its token form sg(s_i) pi_t/sg(pi_t))
    cispo  -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A logp_t         (every token keeps its gradient)

then weighted by the TIS/MIS correction, plus kl_coef x the KL estimate (unless folded into the reward), minus
entropy_coef x the entropy; and summed with `token_scale`, the aggregation (algo.loss_aggregation) of every rank's
tokens into one number.

Taking the engine's logprobs as the old policy makes the ratio carry the training/inference mismatch (bf16
engine vs fp32 trainer, different kernels); rl/corrections.py measures it every step and, with
`algo.correction=tis|mis`, takes the ratio against the trainer's own policy and weights each token by the
truncated (TIS) or masked (MIS) importance weight instead.

With `algo.kl_coef > 0` the loss also pulls the policy toward a frozen reference (trainer/reference.py), GRPO /
DeepSeekMath style: kl_coef * (an estimator of KL(policy || reference)) per response token, in the loss and not in
the reward, unweighted by the corrections above. `kl_estimator` gives each estimator's formula.

Behaviour logprobs must be those of the distribution the engine sampled from: the engine reports processed
logprobs (after temperature and top-p, vLLM's `logprobs_mode="processed_logprobs"`), and trainer/logprobs.py
applies the same temperature and nucleus to the trainer's logits.
"""

from __future__ import annotations

import torch

from colocate.config import AlgoConfig
from colocate.rl.corrections import importance_weights
from colocate.rl.samples import Sequence  # noqa: F401 -- the loss's input, imported from here by its callers
from colocate.trainer.batching import MicroBatch, collate  # noqa: F401 -- likewise
from colocate.trainer.stats import TrainStats

KL_CLAMP = 20.0  # |log r| bound for k3: e^20 is finite in fp32, e^100 (a floored logprob's log r) is not


def kl_estimator(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled token's logprobs (John Schulman,
    "Approximating KL divergence", 2020), with log r = logp_ref - logp:
        k1 = -log r              unbiased value, negative on some tokens, high variance
        k2 = (log r)^2 / 2       >= 0, biased value (slightly, for a small KL)
        k3 = r - 1 - log r       >= 0, unbiased value, low variance (GRPO / DeepSeekMath's choice)
    Gradients flow through `logprobs` only (the reference is frozen). Hazard: as a *loss* on on-policy samples
    their gradients differ from their values' story: in expectation k1's is 0, k2's is that of KL(policy || ref),
    k3's that of KL(ref || policy) (Tang & Munos, "On a few pitfalls in KL divergence gradient estimation for
    RL", 2025)."""
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return log_r.square() / 2
    assert estimator == "k3", estimator
    # Hazard: a token the trainer floors (LOGPROB_FLOOR, outside the nucleus) but the reference does not has
    # log r ~ 100, and e^100 is inf in fp32; inf * 0 in the mask would then make the whole loss NaN.
    log_r = log_r.clamp(-KL_CLAMP, KL_CLAMP)
    return torch.exp(log_r) - 1 - log_r


def token_scale(batch: MicroBatch, *, aggregation: str, num_tokens: int, num_seqs: int,
                max_tokens: int) -> torch.Tensor:
    """[rows, T-1] the weight of each token's loss in the step's one number, over every rank's `num_tokens`
    response tokens in `num_seqs` sequences: what the per-token losses are summed with (zero off the mask).
        token_mean               1 / num_tokens                     (DAPO)
        seq_mean_token_mean      1 / (num_seqs x the sequence's length)   (GRPO)
        seq_mean_token_sum_norm  1 / (num_seqs x max_tokens)        (Dr. GRPO: a constant, no length bias)"""
    mask = batch.target_mask
    if aggregation == "token_mean":
        return mask / max(num_tokens, 1)
    if aggregation == "seq_mean_token_sum_norm":
        return mask / (max(num_seqs, 1) * max_tokens)
    assert aggregation == "seq_mean_token_mean", aggregation
    return mask / (max(num_seqs, 1) * batch.token_lengths())


def surrogate(log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, batch: MicroBatch, *,
              algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy-gradient loss of algo.policy_loss, and where its clip bit (1.0) — before any weights."""
    low, high = 1 - algo.clip_low, 1 + algo.clip_high
    if algo.policy_loss == "gspo":
        seq_log_ratio = batch.per_sequence(log_ratio.detach())[batch.seq_ids] / batch.token_lengths()
        # the value of the sequence ratio, the gradient of each token's own log-prob (GSPO-token, eq. 13)
        log_ratio = seq_log_ratio + (log_ratio - log_ratio.detach())
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, low, high)
    if algo.policy_loss == "cispo":  # its clip bites wherever the weight was clipped
        return -(clipped_ratio.detach() * advantages * logprobs), ((ratio < low) | (ratio > high)).float()
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages
    loss = -torch.minimum(unclipped, clipped)
    bit = (clipped < unclipped).float()  # the min took the clipped term (verl's pg_clipfrac)
    if algo.clip_ratio_c is not None:  # dual clip: a negative advantage's loss is at most c |A|
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * algo.clip_ratio_c), loss)
    return loss, bit


def policy_loss(logprobs: torch.Tensor, batch: MicroBatch, *, algo: AlgoConfig,
                ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                scale: torch.Tensor | None = None,
                advantages: torch.Tensor | None = None) -> tuple[torch.Tensor, TrainStats]:
    """The micro-batch's loss: each response token's (surrogate x correction weight + KL - entropy bonus) summed
    with `scale` (token_scale; None: a plain sum), and the step's statistics, the mismatch among them: every
    response token's log w = logp_trainer - logp_engine and every sequence's sum. `advantages`: per token (the
    trainer's REINFORCE++ returns), else the batch's."""
    mask = batch.target_mask
    scale = mask if scale is None else scale
    advantages = batch.advantages if advantages is None else advantages
    # the proximal policy (algo.old_logprobs=recompute|decoupled: the trainer's before the step's first update);
    # without one, the trainer's own in this forward: equal in value before the first update
    prox = logprobs.detach() if batch.prox_logprobs is None else batch.prox_logprobs
    log_w = (prox - batch.old_logprobs) * mask  # the monitor: trainer against engine, before any update
    if algo.old_logprobs == "recompute":  # the ratio against the recomputed policy, no behaviour correction
        log_ratio, weights, affected = (logprobs - prox) * mask, mask, torch.zeros_like(mask)
    elif algo.correction == "none":
        log_ratio, weights, affected = (logprobs - batch.old_logprobs) * mask, mask, torch.zeros_like(mask)
    else:  # the ratio against the proximal policy; the behaviour mismatch (proximal / engine) moves into the weights
        log_ratio = (logprobs - prox) * mask
        weights, affected = importance_weights(log_w, mask, mode=algo.correction,
                                               level=algo.correction_level, cap=algo.tis_cap,
                                               low=algo.mis_low, high=algo.mis_high, seq_ids=batch.seq_ids)
    per_token, clipped = surrogate(log_ratio, logprobs, advantages, batch, algo=algo)
    per_token = per_token * weights
    kl_sum = torch.zeros(())
    if algo.kl_coef > 0:
        assert ref_logprobs is not None and ref_logprobs.shape == logprobs.shape, "kl_coef > 0 needs ref_logprobs"
        kl = kl_estimator(logprobs, ref_logprobs, algo.kl_estimator) * mask
        if not algo.kl_in_reward:  # else it is in the returns (trainer/token_returns.py)
            per_token = per_token + algo.kl_coef * kl
        kl_sum = kl.detach().sum()
    # how far this update's policy has moved from the step's proximal one (k3, >= 0; 0 without a recomputed one)
    kl_old = kl_estimator(logprobs.detach(), prox, "k3") * mask if batch.prox_logprobs is not None else None
    if algo.entropy_coef > 0:
        assert entropy is not None and entropy.requires_grad, "an entropy bonus needs the entropy's gradient"
        per_token = per_token - algo.entropy_coef * entropy * mask
    loss = (per_token * scale).sum()
    with torch.no_grad():
        on = mask.bool()
        stats = TrainStats(
            tokens=float(mask.sum()), loss_sum=float((per_token * mask).sum()), objective=float(loss),
            mismatch_abs_sum=float(log_w.abs().sum()), clipped_sum=float((clipped * mask).sum()),
            corrected_sum=float(affected.sum()), weight_sum=float(weights.sum()), kl_sum=float(kl_sum),
            kl_old_sum=float(kl_old.sum()) if kl_old is not None else 0.0,
            entropy_sum=float((entropy * mask).sum()) if entropy is not None else 0.0,
            token_log_w=log_w[on].cpu().numpy(),
            seq_log_w=batch.per_sequence(log_w)[batch.per_sequence(mask) > 0].cpu().numpy())
    return loss, stats
