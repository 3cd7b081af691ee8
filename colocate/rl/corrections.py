"""Training/inference mismatch: measure it every step, and correct the policy gradient for it (TIS / MIS).

The engine samples with its own kernels (a bf16 engine, a KV cache, batched decoding); the trainer recomputes
the same tokens in one pass. For every response token t the importance weight of the trainer's policy over the
engine's (the behaviour policy that really produced the token) is

    w_t = p_trainer(t) / p_engine(t),        log w_t = logp_trainer(t) - logp_engine(t)

and for a sequence, w_seq = prod_t w_t (log w_seq = sum_t log w_t). A perfect engine gives w = 1 everywhere.

Corrections (`algo.correction`), each at token or sequence level (`algo.correction_level`):
- none: the PPO ratio is taken against the engine's logprobs, so the mismatch sits inside the clipped ratio.
- tis (truncated importance sampling): the PPO ratio is taken against the trainer's own policy before the
  update (`pi_theta / pi_theta.detach()`: every micro-batch of a step sees the same weights, updated once at
  the end), and the per-token loss is multiplied by min(w, algo.tis_cap).
- mis (masked importance sampling): the same ratio, multiplied by w where w lies in
  [algo.mis_low, algo.mis_high] and by 0 outside: tokens (or whole sequences) the engine sampled from a
  distribution too far from the trainer's are dropped instead of being trusted.

    weights, affected = importance_weights(log_w, mask, mode="tis", level="token", cap=2.0, low=0.5, high=2.0)
    stats = mismatch_stats(token_log_w, seq_log_w, band=1.1)    # mean/max |log w|, ratio quantiles, outside band
"""

from __future__ import annotations

import torch

QUANTILES = (0.001, 0.01, 0.05, 0.5, 0.95, 0.99, 0.999)


def importance_weights(log_w: torch.Tensor, mask: torch.Tensor, *, mode: str, level: str, cap: float, low: float,
                       high: float, seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights [B, T] and where the correction changed a weight (1: truncated by TIS, masked by
    MIS), both zero outside `mask`. `log_w`: logp_trainer - logp_engine per token, detached. `seq_ids`: the
    sequence of each token when a row holds several (packed micro-batches); None: each row is one sequence."""
    assert mode in ("tis", "mis") and level in ("token", "sequence"), (mode, level)
    log_w = log_w.detach() * mask
    if level == "sequence":  # one weight per sequence, the product over its tokens, for all of its tokens
        if seq_ids is None:
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)
        else:
            sums = torch.zeros(int(seq_ids.max()) + 1, dtype=log_w.dtype, device=log_w.device).index_add_(
                0, seq_ids.flatten(), log_w.flatten())
            log_w = sums[seq_ids]
    w = torch.exp(log_w)
    if mode == "tis":
        weights = torch.clamp(w, max=cap)
        affected = w > cap
    else:
        inside = (w >= low) & (w <= high)
        weights = torch.where(inside, w, torch.zeros_like(w))
        affected = ~inside
    return weights * mask, affected.float() * mask


def mismatch_stats(token_log_w: torch.Tensor, seq_log_w: torch.Tensor, *, band: float) -> dict:
    """The mismatch of one step over every response token and sequence (all ranks): mean and max |log w|,
    quantiles of the ratio w, and the fraction outside [1/band, band]."""
    return {"band": band, "token": _summary(token_log_w, band), "sequence": _summary(seq_log_w, band)}


def _summary(log_w: torch.Tensor, band: float) -> dict:
    if log_w.numel() == 0:
        return {"count": 0}
    log_w = log_w.double()
    ratio = torch.exp(log_w)
    quantiles = torch.quantile(ratio, torch.tensor(QUANTILES, dtype=torch.float64))
    outside = (log_w.abs() > torch.log(torch.tensor(band, dtype=torch.float64))).double().mean()
    return {"count": log_w.numel(), "mean_abs_log_ratio": float(log_w.abs().mean()),
            "max_abs_log_ratio": float(log_w.abs().max()), "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max()), "fraction_outside_band": float(outside),
            "ratio_quantiles": {f"p{q * 100:g}": float(v) for q, v in zip(QUANTILES, quantiles)}}
