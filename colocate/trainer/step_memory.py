"""What one training micro-batch holds on a trainer rank beyond its state: activations kept for backward, the
loss's log-prob pass over the vocabulary, and FSDP2's unsharded groups. Pure arithmetic on the model's
dimensions, for the preflight (before any actor starts) and for `colocate bench train-memory`, which checks it
against a real train step's measured peak.

    parts = micro_batch_parts(dims, num_tokens=2 * 1088, micro_batch_size=2, compute_bytes=2, temperature=1.0,
                              top_p=1.0)
    parts["activations kept for backward"], parts["logits and log-softmax"], ...

Activations, per token (h hidden, q = heads x head_dim, kv = kv heads x head_dim, i intermediate, c the compute
dtype's bytes: 4, or 2 under bf16 mixed precision). Read from transformers' Qwen2 decoder
(models/qwen2/modeling_qwen2.py), what autograd saves in each op's backward node:

- RMSNorm (`Qwen2RMSNorm.forward`): its input upcast to fp32 (the pow and the product keep it), the fp32
  rsqrt, the normalised value cast back (the weight's product keeps it): 4h + 4 + c h;
- the projection after it (q/k/v, or gate/up: one shared input): its input, c h;
- attention (sdpa, flash kernels on CPU and CUDA): rotated q, k, v, the output (which o_proj keeps too: the
  same storage) and the log-sum-exp per head: c (2q + 2kv) + 4 heads;
- MLP (`Qwen2MLP.forward`, down(act(gate(x)) * up(x))): gate's output (SiLU keeps it), SiLU's and up's outputs
  (the product keeps both), the product (down keeps it): 4 c i.

A layer has two norm+projection pairs, so `2 (4h + 4 + 2c h) + c (2q + 2kv) + 4 heads + 4 c i`; fp32:
32h + 8kv + 16i + 24 bytes (about 8h + 2kv + 4i values), bf16: 20h + 4kv + 8i + 24. The final norm and lm_head's
input add `4h + 4 + 2c h`, the rotary cos/sin `2 c head_dim`, the input ids 8. tests/unit/test_step_memory.py
walks a real Qwen2's autograd graph and finds exactly these bytes in fp32 and bf16.

The log-prob pass (trainer/logprobs.py) over V vocabulary entries per token: the model's logits (c V, alive through
the backward: the train step holds them), an fp32 copy or the temperature's quotient (4V; neither in fp32 at
temperature 1, where `logits.float()` returns the logits themselves), log-softmax's output (4V, kept for backward),
and in the backward the gather's and log-softmax's gradients (4V each): `(c + 12) V` at the peak, `(c + 8) V` in
fp32 at temperature 1, whichever of forward and backward it falls in. A nucleus (top_p < 1) adds the sort's values
and int64 indices, the softmax, the cumulative sum, the mask and two [tokens, V] results: `17 V` more. Chunked
(`trainer.logprob_chunk_tokens`, trainer/logprobs.py), that peak is one chunk's: each chunk's forward frees its
logits, and its recompute in the backward holds the same again; every token keeps 16 bytes of output. The entropy (a
metric, no gradient) is taken 256 positions at a time, beside no peak of its own.

Padding: a micro-batch of rows of unequal length carries transformers' [rows, 1, T, T] boolean sdpa mask, and
every layer's attention keeps its own copy converted to the compute dtype for its backward (aten's
scaled_dot_product_attention turns a boolean mask into an additive one before it picks a kernel, and the kernel's
backward node keeps it): `rows T^2 (1 + layers c)` bytes, quadratic in the length. A micro-batch of one row
needs no mask (sdpa runs causal). With a mask, k and v are kept at the query heads' size (grouped-query sdpa
runs without a mask only). tests/unit/test_step_memory.py finds both in the graph too.

FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, `foreach_reduce`): a group's reduce-scatter
copies its unsharded gradients into one flat buffer in the reduce dtype (fp32) before it frees them, so the
largest group's gradients exist twice for a moment.
"""

from __future__ import annotations

from typing import Protocol

from colocate.config.algo import GREEDY_TEMPERATURE

FP32 = 4
LOGITS_BYTES_PER_VOCAB = 8  # beyond the model's own logits: log-softmax's output, then two gradients of it
COPY_BYTES_PER_VOCAB = 4  # an fp32 copy (bf16 logits) or the temperature's quotient; fp32 at T=1 makes neither
NUCLEUS_BYTES_PER_VOCAB = 17  # top_p < 1: sort values + int64 indices, softmax, mask, masked and scattered copies
CHUNKED_OUTPUT_BYTES = 16  # chunked head: (logprob, entropy) in fp32 per token, in the chunks and concatenated


class Dims(Protocol):
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    layer_params: int
    root_params: int
    tie_word_embeddings: bool


def _norm_and_projection(dims: Dims, c: int) -> int:
    """An RMSNorm and the projection after it: the fp32 input and rsqrt, the normalised value, the input."""
    return FP32 * dims.hidden_size + FP32 + 2 * c * dims.hidden_size


def layer_bytes_per_token(dims: Dims, *, compute_bytes: int, masked: bool = False) -> int:
    """What one decoder layer keeps per token for its backward (the table above)."""
    c = compute_bytes
    q = dims.num_heads * dims.head_dim
    kv = q if masked else dims.num_kv_heads * dims.head_dim
    attention = c * (2 * q + 2 * kv) + FP32 * dims.num_heads
    return 2 * _norm_and_projection(dims, c) + attention + 4 * c * dims.intermediate_size


def checkpointed_bytes_per_token(dims: Dims, *, compute_bytes: int) -> int:
    """trainer.activation_checkpointing: each layer keeps only its input (the hidden states, in the compute dtype:
    FSDP2 casts the layer's inputs), the final norm and lm_head theirs; a layer's own activations exist only
    while the backward recomputes it (micro_batch_parts adds the largest, one layer's)."""
    return dims.num_layers * compute_bytes * dims.hidden_size + _norm_and_projection(dims, compute_bytes) + 8


def saved_bytes_per_token(dims: Dims, *, compute_bytes: int, masked: bool = False) -> int:
    """Bytes autograd keeps per token through the decoder, for the backward (the table above). `masked`: sdpa
    gets a padding mask, and transformers then repeats k and v to every query head before the kernel
    (integrations/sdpa_attention.py `use_gqa_in_sdpa`: grouped-query sdpa only without a mask), so the kernel
    keeps them that size."""
    layer = layer_bytes_per_token(dims, compute_bytes=compute_bytes, masked=masked)
    # + the final norm and lm_head's input, the ids
    return dims.num_layers * layer + _norm_and_projection(dims, compute_bytes) + 8


def rotary_bytes(dims: Dims, *, num_tokens: int, compute_bytes: int) -> int:
    return 2 * compute_bytes * dims.head_dim * num_tokens  # cos and sin, shared by every layer


def logits_bytes_per_token(dims: Dims, *, compute_bytes: int, temperature: float, top_p: float) -> int:
    if temperature < GREEDY_TEMPERATURE:  # scored as the plain distribution (trainer/logprobs.py)
        temperature, top_p = 1.0, 1.0
    copy = COPY_BYTES_PER_VOCAB if compute_bytes != FP32 or temperature != 1.0 else 0
    per_vocab = compute_bytes + copy + LOGITS_BYTES_PER_VOCAB + (NUCLEUS_BYTES_PER_VOCAB if top_p < 1.0 else 0)
    return per_vocab * dims.vocab_size


def attention_mask_bytes(dims: Dims, *, rows: int, length: int, compute_bytes: int,
                         num_layers: int | None = None) -> int:
    """The padded micro-batch's boolean mask and each layer's additive copy of it (`num_layers` copies alive)."""
    return rows * length * length * (1 + (dims.num_layers if num_layers is None else num_layers) * compute_bytes)


def kept_group_params(dims: Dims) -> int:
    """The FSDP2 group alive, unsharded, from the end of the forward into the backward (trainer/fsdp.py
    shard_by_layer): untied, lm_head's own group; tied, the root (embeddings = lm_head, final norm)."""
    return dims.root_params if dims.tie_word_embeddings else dims.vocab_size * dims.hidden_size


def unsharded_group_bytes(dims: Dims, *, compute_bytes: int) -> int:
    """At the backward's start: the kept group (above) unsharded with its full gradients until its
    reduce-scatter; of the decoder layers, the current one, the prefetched one and one layer's unsharded
    gradients; and the reduce-scatter's flat fp32 input of the larger group. The untied embeddings are resharded
    after their forward, and gathered again only at the end of the backward, when the activations are gone."""
    kept = kept_group_params(dims)
    return compute_bytes * (2 * kept + 3 * dims.layer_params) + FP32 * max(kept, dims.layer_params)


def logprob_pass_bytes(dims: Dims, *, num_tokens: int, compute_bytes: int, temperature: float, top_p: float,
                       chunk_tokens: int | None) -> int:
    """The log-prob pass's peak: all tokens' logits at once, or one chunk's (trainer.logprob_chunk_tokens; its
    forward and its recompute in the backward hold the same) plus every token's two fp32 outputs (logprob and
    entropy), in the chunks and in their concatenation."""
    per_token = logits_bytes_per_token(dims, compute_bytes=compute_bytes, temperature=temperature, top_p=top_p)
    if chunk_tokens is None:
        return num_tokens * per_token
    return min(num_tokens, chunk_tokens) * per_token + num_tokens * CHUNKED_OUTPUT_BYTES


def micro_batch_parts(dims: Dims, *, num_tokens: int, micro_batch_size: int, compute_bytes: int,
                      temperature: float, top_p: float, chunk_tokens: int | None = None,
                      checkpointed: bool = False, masked: bool | None = None) -> dict[str, int]:
    """What one micro-batch of `num_tokens` (`micro_batch_size` rows x padded length) adds on a rank while it
    trains. `masked`: whether attention takes a materialised mask; None: when rows are padded (more than one).
    A packed row (one row of several sequences) has one under sdpa and eager, none under flash-attention varlen.

    Checkpointed, the backward meets the log-prob pass first and recomputes the layers after it: the pass's
    temporaries are freed by then, and what stays is the logits (unchunked) or the chunks' outputs. The peak is
    the larger of the two moments, so the recompute counts only what it adds beyond the pass."""
    length, c = num_tokens // micro_batch_size, compute_bytes
    masked = micro_batch_size > 1 if masked is None else masked
    rotary = rotary_bytes(dims, num_tokens=length, compute_bytes=c)
    logprob_pass = logprob_pass_bytes(dims, num_tokens=num_tokens, compute_bytes=c, temperature=temperature,
                                      top_p=top_p, chunk_tokens=chunk_tokens)
    if checkpointed:
        recompute = num_tokens * layer_bytes_per_token(dims, compute_bytes=c, masked=masked)
        left = num_tokens * (CHUNKED_OUTPUT_BYTES if chunk_tokens is not None else c * dims.vocab_size)
        parts = {"activations kept for backward": num_tokens * checkpointed_bytes_per_token(dims, compute_bytes=c)
                 + rotary,
                 "one layer recomputed": max(0, left + recompute - logprob_pass)}
    else:
        parts = {"activations kept for backward": num_tokens * saved_bytes_per_token(dims, compute_bytes=c,
                                                                                   masked=masked) + rotary}
    parts["logits and log-softmax"] = logprob_pass
    if masked:
        # checkpointed: only the layer being recomputed makes its additive copy of the mask
        parts["attention masks"] = attention_mask_bytes(dims, rows=micro_batch_size, length=length,
                                                        compute_bytes=c, num_layers=1 if checkpointed else None)
    return parts
