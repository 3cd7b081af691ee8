"""The GRPO policy loss on sampled sequences, with the engine's sampling logprobs as the behaviour policy.

Sequence layout (one row per sample):

    tokens:    p0 p1 p2 | r0 r1 r2 <eos>          (prompt | response, right-padded)
    logits t predicts token t+1, so response token j is scored by the logits at position len(prompt) + j - 1.

Loss per response token (PPO-clip with group-relative advantages):
    ratio = exp(logp_trainer - logp_engine)
    loss  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)

Taking the engine's logprobs as the old policy makes the ratio carry the training/inference mismatch (bf16
engine vs fp32 trainer, different kernels); `mismatch` reports its size every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sequence:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the engine's logprob of each response token when it was sampled
    advantage: float


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    target_mask: torch.Tensor  # [B, T-1], 1 where the target token is a response token
    old_logprobs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B]


def collate(seqs: list[Sequence], *, pad_id: int, device: torch.device) -> MicroBatch:
    length = max(len(s.prompt_ids) + len(s.response_ids) for s in seqs)
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), length), dtype=torch.long)
    target_mask = torch.zeros((len(seqs), length - 1))
    old_logprobs = torch.zeros((len(seqs), length - 1))
    for i, s in enumerate(seqs):
        tokens = s.prompt_ids + s.response_ids
        input_ids[i, :len(tokens)] = torch.tensor(tokens)
        attention_mask[i, :len(tokens)] = 1
        first = len(s.prompt_ids) - 1
        target_mask[i, first:first + len(s.response_ids)] = 1
        old_logprobs[i, first:first + len(s.response_ids)] = torch.tensor(s.logprobs)
    advantages = torch.tensor([s.advantage for s in seqs])
    return MicroBatch(*(t.to(device) for t in (input_ids, attention_mask, target_mask, old_logprobs, advantages)))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """logprob of each next token: [B, T-1]."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.gather(logprobs, 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def policy_loss(logprobs: torch.Tensor, batch: MicroBatch, *, clip_eps: float) -> tuple[torch.Tensor, dict]:
    """Sum over response tokens of the clipped surrogate loss (the caller normalises by the token count)."""
    mask = batch.target_mask
    log_ratio = (logprobs - batch.old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    advantages = batch.advantages.unsqueeze(1)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    loss = -(torch.minimum(unclipped, clipped) * mask).sum()
    with torch.no_grad():
        stats = {
            "tokens": float(mask.sum()),
            "mismatch_abs_sum": float((log_ratio.abs() * mask).sum()),  # |logp_trainer - logp_engine|
            "clipped_sum": float(((unclipped != clipped).float() * mask).sum()),
        }
    return loss, stats
