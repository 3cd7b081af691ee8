"""The GRPO policy loss on sampled sequences, with the engine's sampling logprobs as the behaviour policy.

Every tensor is per target position of a micro-batch (trainer/batching.py: padded or packed, the same here).

Loss per response token (PPO-clip with group-relative advantages):
    ratio = exp(logp_trainer - logp_engine)
    loss  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)

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


def policy_loss(logprobs: torch.Tensor, batch: MicroBatch, *, algo: AlgoConfig,
                ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, TrainStats]:
    """Sum over response tokens of the clipped surrogate loss plus, when algo.kl_coef > 0, kl_coef times the
    KL estimate against `ref_logprobs` (the caller normalises by the token count: the KL term becomes kl_coef *
    its per-token mean); and the step's mismatch: every response token's log w = logp_trainer - logp_engine and
    every sequence's sum."""
    mask = batch.target_mask
    log_w = (logprobs.detach() - batch.old_logprobs) * mask
    if algo.correction == "none":
        log_ratio, weights, affected = (logprobs - batch.old_logprobs) * mask, mask, torch.zeros_like(mask)
    else:  # the ratio against the trainer's own policy (1 in value); the mismatch moves into the weights
        log_ratio = (logprobs - logprobs.detach()) * mask
        weights, affected = importance_weights(log_w, mask, mode=algo.correction,
                                               level=algo.correction_level, cap=algo.tis_cap,
                                               low=algo.mis_low, high=algo.mis_high, seq_ids=batch.seq_ids)
    ratio = torch.exp(log_ratio)
    advantages = batch.advantages
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - algo.clip_eps, 1 + algo.clip_eps) * advantages
    loss = -(torch.minimum(unclipped, clipped) * weights).sum()
    kl_sum = torch.zeros(())
    if algo.kl_coef > 0:
        assert ref_logprobs is not None and ref_logprobs.shape == logprobs.shape, "kl_coef > 0 needs ref_logprobs"
        kl = kl_estimator(logprobs, ref_logprobs, algo.kl_estimator) * mask
        loss = loss + algo.kl_coef * kl.sum()
        kl_sum = kl.detach().sum()
    with torch.no_grad():
        on = mask.bool()
        stats = TrainStats(
            tokens=float(mask.sum()), loss_sum=float(loss.detach()),
            mismatch_abs_sum=float(log_w.abs().sum()), clipped_sum=float(((unclipped != clipped).float() * mask).sum()),
            corrected_sum=float(affected.sum()), weight_sum=float(weights.sum()), kl_sum=float(kl_sum),
            entropy_sum=float((entropy * mask).sum()) if entropy is not None else 0.0,
            token_log_w=log_w[on].cpu().numpy(),
            seq_log_w=batch.per_sequence(log_w)[batch.per_sequence(mask) > 0].cpu().numpy())
    return loss, stats
