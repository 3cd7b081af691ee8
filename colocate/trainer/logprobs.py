"""The log-prob pass: each sampled token's log-probability under the distribution the engine drew it from, and
that distribution's entropy, from the model's last hidden states.

    install_chunked_head(model, chunk_tokens=1024)        # before fully_shard: lm_head becomes a ChunkedLogprobHead
    logprobs, entropy = sequence_logprobs(model, batch, temperature=t, top_p=p)   # [B, T-1] each

Chunked (`trainer.logprob_chunk_tokens`), the head computes lm_head, temperature, top-p, log-softmax and the
gather for `chunk_tokens` positions at a time, each chunk under a non-reentrant activation checkpoint: the forward
keeps only the chunk's hidden states (its input) and two floats per token, and the backward recomputes the chunk's
logits. The full [tokens, vocab] fp32 logits (4 bytes x 152k vocabulary = 0.6 MB a token for Qwen2.5: 2.4 GB at
4k tokens, x2 or x3 with top-p's sorted copies and log-softmax's output) never exist; one chunk's do.

The head runs *inside* the model's forward, as lm_head did, so FSDP2's hooks see it: untied, lm_head is a group of
its own (trainer/fsdp.py), unsharded by its pre-forward hook and kept so (reshard_after_forward=False) into its
backward, whose recompute reads the full weight before the post-backward hook reduce-scatters the gradient; tied,
it is the root's, unsharded from the forward to the end of the backward (torch/distributed/fsdp/_fully_shard/
_fsdp_state.py: the root is not resharded after forward). The recompute of a chunk runs inside the head's
backward, after its pre-backward hook, as a checkpointed decoder layer's does (trainer/fsdp.py checkpoint_layers).
Calling lm_head from outside the forward would read a sharded DTensor.

Both paths apply `processed_logprobs` to the same rows: chunked values equal the full pass's up to the matmul's
row blocking (tests/unit/test_logprobs.py: within 1e-6).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from colocate.config.algo import GREEDY_TEMPERATURE

LOGPROB_FLOOR = -100.0  # a token outside the nucleus: probability e^-100, as good as impossible, and finite
ENTROPY_ROWS = 256  # positions per slice of the entropy (a metric, no gradient)


def processed_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                       top_p: float = 1.0, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits [..., V] and target ids [...]: the target's logprob under the distribution the engine samples
    from, and that distribution's entropy (a metric, without gradient, unless `entropy_grad`: the entropy bonus).
    The logits divided by the temperature, then restricted to the nucleus of mass `top_p` and renormalised
    (vLLM's `apply_top_k_top_p`: drop the smallest tokens whose cumulative probability stays <= 1 - top_p, keep at
    least one). Greedy sampling (temperature below
    vLLM's 1e-5) is scored as vLLM reports it: the plain distribution, no temperature, no nucleus
    (vllm/v1/sample/sampler.py, the all-greedy branch)."""
    logits = logits.float()
    if temperature < GREEDY_TEMPERATURE:
        temperature, top_p = 1.0, 1.0
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        # Hazard (memory): sorts the vocabulary at every position; a [..., V] copy beside the logits
        ordered, order = logits.sort(dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = torch.gather(logprobs, -1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = _entropy_with_grad(logprobs) if entropy_grad else _entropy(logprobs)
    # Hazard: outside the nucleus a token's logprob is -inf (a padding target, or a sampled token the trainer
    # ranks just outside it): -inf * 0 in a mask is NaN. A floor keeps it finite and its gradient zero.
    return (chosen.clamp(min=LOGPROB_FLOOR) if top_p < 1.0 else chosen), entropy


@torch.no_grad()
def _entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dimension, ENTROPY_ROWS positions at a time: its temporaries (p, the masked
    log p, their product: ~13 bytes per vocabulary entry) would otherwise add a third to the full pass's peak."""
    flat = logprobs.reshape(-1, logprobs.shape[-1])
    parts = []
    for i in range(0, flat.shape[0], ENTROPY_ROWS):
        rows = flat[i:i + ENTROPY_ROWS]
        # outside the nucleus p = 0 and log p = -inf: 0 * -inf is NaN, the term is 0
        parts.append(-(rows.exp() * rows.masked_fill(torch.isinf(rows), 0.0)).sum(dim=-1))
    return torch.cat(parts).reshape(logprobs.shape[:-1]) if parts else logprobs.new_zeros(logprobs.shape[:-1])


def _entropy_with_grad(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum p log p with its gradient, in one piece. Hazard (memory): autograd keeps p and the masked log p for
    the backward, ~8 bytes per vocabulary entry a position; with the chunked head (the default) that is one
    chunk's, recomputed in the backward."""
    return -(logprobs.exp() * logprobs.masked_fill(torch.isinf(logprobs), 0.0)).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0,
                   top_p: float = 1.0) -> torch.Tensor:
    """[B, T-1] logprob of each next token of `input_ids` from the model's full logits [B, T, V]."""
    return processed_logprobs(logits[:, :-1], input_ids[:, 1:], temperature=temperature, top_p=top_p)[0]


class ChunkedLogprobHead(torch.nn.Module):
    """lm_head's replacement. Outside `scoring` it is lm_head (logits). Inside, its forward returns [B, T, 2]:
    each position's (logprob of the target, entropy), computed `chunk_tokens` positions at a time."""

    def __init__(self, linear: torch.nn.Linear, chunk_tokens: int, *, fp32_logits: bool = False):
        super().__init__()
        assert linear.bias is None, "no bias in the causal LM heads this replaces"
        self.weight = linear.weight  # the same Parameter: an embedding tied to it stays tied
        self.chunk_tokens = chunk_tokens
        self.fp32_logits = fp32_logits
        self._scoring: tuple[torch.Tensor, float, float, bool] | None = None

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, *, temperature: float, top_p: float, entropy_grad: bool = False):
        """targets [B, T]: the token each position predicts (the last position's is never read)."""
        self._scoring = (targets, temperature, top_p, entropy_grad)
        try:
            yield
        finally:
            self._scoring = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head's projection. fp32_logits (trainer.fp32_lm_head): the hidden states and weight as FSDP2 hands
        them to the head (bf16 under mixed precision) are cast to fp32 and multiplied there, as vLLM's
        head_dtype=float32 does (model_executor/layers/logits_processor.py `_apply_head`): both sides start from
        the same bf16 values and neither rounds the logits to bf16, whose spacing is 0.125 at |logit| 16-32.
        Hazard (memory): an fp32 copy of the whole weight per chunk, and in the backward its fp32 gradient
        (4 x vocab x hidden each: 2.2 GB for Qwen2.5-7B), counted by the preflight (trainer/step_moments.py)."""
        if self.fp32_logits:
            return F.linear(hidden.float(), self.weight.float())
        return F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._scoring is None:
            return self.logits(hidden)
        targets, temperature, top_p, entropy_grad = self._scoring
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        parts = [checkpoint(self._chunk, flat[i:i + self.chunk_tokens], flat_targets[i:i + self.chunk_tokens],
                            temperature, top_p, entropy_grad, use_reentrant=False)
                 for i in range(0, flat.shape[0], self.chunk_tokens)]
        return torch.cat(parts).reshape(*hidden.shape[:-1], 2)

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float,
               entropy_grad: bool) -> torch.Tensor:
        chosen, entropy = processed_logprobs(self.logits(hidden), targets, temperature=temperature, top_p=top_p,
                                             entropy_grad=entropy_grad)
        return torch.stack([chosen, entropy], dim=-1)


def install_chunked_head(model: torch.nn.Module, chunk_tokens: int, *, fp32_logits: bool = False) -> None:
    """Replace the model's lm_head by a ChunkedLogprobHead, before fully_shard (the parameter keeps its name);
    `fp32_logits`: trainer.fp32_lm_head."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"trainer.logprob_chunk_tokens={chunk_tokens}: {type(model).__name__}'s output layer is "
                         f"a {type(head).__name__}, not a bias-free Linear; set trainer.logprob_chunk_tokens=null")
    model.lm_head = ChunkedLogprobHead(head, chunk_tokens, fp32_logits=fp32_logits)


def sequence_logprobs(model: torch.nn.Module, batch, *, temperature: float, top_p: float,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T-1] logprob of each next token of `batch` and [B, T-1] entropy of the distribution it came from (with
    its gradient when `entropy_grad`), through the chunked head if the model has one, else from the full logits."""
    head = model.get_output_embeddings()
    if isinstance(head, ChunkedLogprobHead):
        targets = F.pad(batch.input_ids[:, 1:], (0, 1))  # the last position predicts nothing
        with head.scoring(targets, temperature=temperature, top_p=top_p, entropy_grad=entropy_grad):
            out = model(**batch.model_inputs()).logits[:, :-1]
        return out[..., 0], out[..., 1]
    logits = model(**batch.model_inputs()).logits
    return processed_logprobs(logits[:, :-1], batch.input_ids[:, 1:], temperature=temperature, top_p=top_p,
                              entropy_grad=entropy_grad)
