"""How a train step's sequences become micro-batches: dealt to the ranks by tokens, grouped into micro-batches
(a fixed number of sequences, or as many as a token budget holds), and laid out padded or packed.

    shares = deal(sequences, num_ranks)                                  # every rank about the same tokens
    groups = group_micro_batches(shares[rank], max_seqs=16, max_tokens=8192, packed=True)
    batch = collate(groups[0], pad_id=0, device=cpu, packed=True)       # one row, positions restarting

Padded, a micro-batch is one row per sequence, right-padded to the longest, with an attention mask:

    tokens:    p0 p1 p2 | r0 r1 r2 <eos>          (prompt | response, then padding)
    logits t predicts token t+1, so response token j is scored by the logits at position len(prompt) + j - 1.

Packed, it is a single row of the sequences end to end, no padding and no attention mask: `position_ids`
restart at 0 for each sequence, and the model keeps attention inside each one from them. transformers'
masking (masking_utils.find_packed_sequence_indices, when attention_mask is None and no cache is passed) turns
the restarts into a block-diagonal causal mask for sdpa and eager attention; flash-attention's varlen kernel
takes the same restarts as cumulative sequence lengths (modeling_flash_attention_utils), with no mask at all.
The last position of a sequence predicts the next sequence's first token: it is never a target.

Every tensor past the inputs is per target position ([rows, T-1]), the advantage and the sequence index
included, so the loss and the per-sequence sums read the same in both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colocate.rl.routing import sequence_routing
from colocate.rl.samples import Sequence


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [rows, T]
    attention_mask: torch.Tensor | None  # [rows, T]; None when packed
    position_ids: torch.Tensor | None  # [rows, T] restarting per sequence when packed; None when padded
    target_mask: torch.Tensor  # [rows, T-1], 1 where the target token is a response token
    old_logprobs: torch.Tensor  # [rows, T-1], the engine's logprob of each target
    advantages: torch.Tensor  # [rows, T-1], each target's sequence's advantage
    seq_ids: torch.Tensor  # [rows, T-1] long, the sequence (0..num_seqs-1) of each target; 0 off the mask
    spans: list[tuple[int, int, int]]  # per sequence: (row, first target position, number of response tokens)
    num_trained: list[int] | None = None
    """Per sequence, its response tokens on the mask (fewer than the span's when an environment's observations
    are in it); None: the spans' counts."""
    prox_logprobs: torch.Tensor | None = None
    """[rows, T-1] the proximal policy's logprob of each target (Sequence.old_logprobs); None: no sequence has one."""
    routing: torch.Tensor | None = None
    """algo.router_replay: [rows, T, layers, top_k] long, the engine's experts of each input position, -1 where
    the router chooses (padding, each sequence's last token); None: no sequence carries a routing."""
    returns: torch.Tensor | None = None
    """algo.advantage=gae: [rows, T-1] each target's return (the critic's target); None: no critic."""
    old_values: torch.Tensor | None = None
    """algo.advantage=gae: [rows, T-1] each target's value before the step's first update; None: no critic."""

    @property
    def num_seqs(self) -> int:
        return len(self.spans)

    def token_lengths(self) -> torch.Tensor:
        """[rows, T-1] the trained length of each target's sequence (1 off the mask, never a divisor of 0)."""
        counts = self.num_trained if self.num_trained is not None else [num for _, _, num in self.spans]
        lengths = torch.tensor(counts, dtype=self.target_mask.dtype, device=self.target_mask.device)
        return lengths.clamp(min=1)[self.seq_ids]

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """[num_seqs] sums of `values` ([rows, T-1]) over each sequence's response targets."""
        masked = (values * self.target_mask).flatten()
        return torch.zeros(self.num_seqs, dtype=values.dtype, device=values.device).index_add_(
            0, self.seq_ids.flatten(), masked)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments. No cache: transformers detects packing only without one, and a
        training forward has no use for one."""
        inputs = {"input_ids": self.input_ids, "use_cache": False}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        else:
            inputs["attention_mask"] = self.attention_mask
        return inputs


def sequence_tokens(s: Sequence) -> int:
    return len(s.prompt_ids) + len(s.response_ids)


def collate(seqs: list[Sequence], *, pad_id: int, device: torch.device, packed: bool = False) -> MicroBatch:
    lengths = [sequence_tokens(s) for s in seqs]
    rows, width = (1, sum(lengths)) if packed else (len(seqs), max(lengths))
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = None if packed else torch.zeros((rows, width), dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long) if packed else None
    target_mask = torch.zeros((rows, width - 1))
    old_logprobs = torch.zeros((rows, width - 1))
    advantages = torch.zeros((rows, width - 1))
    seq_ids = torch.zeros((rows, width - 1), dtype=torch.long)
    prox = torch.zeros((rows, width - 1)) if any(s.old_logprobs is not None for s in seqs) else None
    valued = any(s.returns is not None for s in seqs)
    returns = torch.zeros((rows, width - 1)) if valued else None
    old_values = torch.zeros((rows, width - 1)) if valued else None
    routed = [s.routing for s in seqs if s.routing is not None]
    routing = torch.full((rows, width, *routed[0].shape[1:]), -1, dtype=torch.long) if routed else None
    spans, num_trained, offset = [], [], 0
    for i, (s, length) in enumerate(zip(seqs, lengths)):
        row, start = (0, offset) if packed else (i, 0)
        input_ids[row, start:start + length] = torch.tensor(s.prompt_ids + s.response_ids)
        if packed:
            position_ids[row, start:start + length] = torch.arange(length)
        else:
            attention_mask[row, :length] = 1
        first, num = start + len(s.prompt_ids) - 1, len(s.response_ids)
        # multi-turn: an environment's observation tokens are context, never targets (rl.samples.Sequence.mask)
        target_mask[row, first:first + num] = 1 if s.mask is None else torch.tensor(s.mask, dtype=target_mask.dtype)
        old_logprobs[row, first:first + num] = torch.tensor(s.logprobs)
        if prox is not None:
            assert s.old_logprobs is not None, "a micro-batch's sequences all have a proximal policy or none do"
            prox[row, first:first + num] = torch.tensor(s.old_logprobs)
        advantages[row, first:first + num] = s.advantage if s.token_advantages is None else \
            torch.tensor(s.token_advantages)
        if valued:
            assert s.returns is not None and s.old_values is not None, "a micro-batch's sequences all have values"
            returns[row, first:first + num] = torch.tensor(s.returns)
            old_values[row, first:first + num] = torch.tensor(s.old_values)
        seq_ids[row, first:first + num] = i
        if routing is not None:
            routing[row, start:start + length] = torch.from_numpy(
                sequence_routing(s.routing, length, *routing.shape[2:]))
        spans.append((row, first, num))
        num_trained.append(s.num_trained_tokens)
        offset += length
    tensors = (input_ids, attention_mask, position_ids, target_mask, old_logprobs, advantages, seq_ids)
    def moved(t):
        return None if t is None else t.to(device)

    return MicroBatch(*(moved(t) for t in tensors), spans=spans, num_trained=num_trained, routing=moved(routing),
                      prox_logprobs=moved(prox), returns=moved(returns), old_values=moved(old_values))


def micro_batch_tokens(lengths: list[int], *, packed: bool) -> int:
    """The tokens a micro-batch of sequences of `lengths` computes: their sum packed, rows x longest padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths)


def deal(sequences: list[Sequence], num_ranks: int) -> list[list[Sequence]]:
    """Each rank's share: longest first, each to the rank with the fewest tokens so far (then the fewest
    sequences), so no rank trains much longer than another. Deterministic: every caller gets the same deal."""
    shares: list[list[Sequence]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for s in sorted(sequences, key=sequence_tokens, reverse=True):
        rank = min(range(num_ranks), key=lambda r: (tokens[r], len(shares[r]), r))
        shares[rank].append(s)
        tokens[rank] += sequence_tokens(s)
    return shares


def trainer_micro_batches(seqs: list[Sequence], cfg) -> list[list[Sequence]]:
    """One rank's micro-batches as the trainer config groups them: the rank itself, the driver counting every
    rank's (job/groups.py) and the bench all call this, so their counts cannot drift apart."""
    return group_micro_batches(list(seqs), max_seqs=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_micro_batch,
                               packed=cfg.pack_sequences)


def group_micro_batches(seqs: list[Sequence], *, max_seqs: int, max_tokens: int | None,
                        packed: bool) -> list[list[Sequence]]:
    """One rank's micro-batches. Without a budget: `max_seqs` sequences each, in order. With one: first-fit
    decreasing, as many sequences as `max_tokens` holds (micro_batch_tokens), each at most `max_seqs` when
    padded (packed, a micro-batch is one row whatever its count). The longest sequence must fit the budget
    alone: the job's checks refuse a budget under the longest sequence the engine can return."""
    if max_tokens is None:
        return [seqs[i:i + max_seqs] for i in range(0, len(seqs), max_seqs)]
    groups: list[list[Sequence]] = []
    for s in sorted(seqs, key=sequence_tokens, reverse=True):
        length = sequence_tokens(s)
        assert length <= max_tokens, f"a {length}-token sequence over the {max_tokens}-token budget"
        for group in groups:
            lengths = [sequence_tokens(t) for t in group] + [length]
            if micro_batch_tokens(lengths, packed=packed) <= max_tokens and (packed or len(group) < max_seqs):
                group.append(s)
                break
        else:
            groups.append([s])
    return groups


def attention_implementation(cfg, device: str) -> str:
    """The attention the trainer loads its model with. Packed rows on CUDA take flash-attention's varlen kernel
    when flash_attn is installed and the compute is half precision (its kernels take no fp32; FSDP2's mixed
    precision computes in bf16): no mask, cumulative lengths from position_ids. Everywhere else sdpa, whose mask
    transformers builds from the padding or, packed, from position_ids."""
    import importlib.util

    if device == "cuda" and cfg.pack_sequences and cfg.mixed_precision and importlib.util.find_spec("flash_attn"):
        return "flash_attention_2"
    return "sdpa"
