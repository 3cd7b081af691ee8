"""What one training micro-batch holds on a trainer rank, per token: the activations autograd keeps for the
backward, and the log-prob pass over the vocabulary. Pure arithmetic on the model's dimensions; the moments of a
train step that these add up in (FSDP2's groups, the gradients as they build up, AdamW's step) are
trainer/step_moments.py's.

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

CUDA's math attention: fp32 grouped-query attention without a mask has no fused kernel on CUDA. Flash attention
takes half precision only (`check_dtypes_low_precision`), memory-efficient attention refuses grouped-query heads
(`check_batch_size_and_num_heads_dense<false>`; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
`can_use_flash_attention` / `can_use_mem_efficient_attention`), and transformers passes `enable_gqa` when there is
no mask (integrations/sdpa_attention.py `use_gqa_in_sdpa`), so sdpa falls to `_scaled_dot_product_attention_math`
(aten/src/ATen/native/transformers/attention.cpp): it keeps the scaled q, k and v repeated to every head, o_proj's
contiguous input, and the softmax's [heads, T, T] output in the compute dtype: `4 c q + c heads T` bytes a token.
At 4,096 tokens of Qwen2.5-7B that is 1.75 GiB a layer. The CPU's flash kernel takes fp32 and grouped heads.

The log-prob pass (trainer/logprobs.py) over V vocabulary entries per token, measured op by op with torch's
MemTracker (tests/unit/test_step_memory.py):
- forward: the model's logits (c V; unchunked the caller holds them through the pass, a chunk's go once copied),
  an fp32 copy or the temperature's quotient (4V; neither in fp32 at temperature 1, where `logits.float()` returns
  the logits themselves) and log-softmax's output (4V): `(c + copy + 4) V` unchunked, `8 V` a chunk; the entropy
  (a metric, no gradient) adds 12 bytes x V for its 256-position slice, whatever the length;
- backward: log-softmax's saved output, its incoming gradient (the gather's scatter) and its result: `12 V`,
  in any dtype. The logits and their copy are gone by then (nothing saves them).
A nucleus (top_p < 1: the sort's values and int64 indices, the softmax, the cumulative sum, the mask, two
[tokens, V] results) adds 26 V forward (beside which the entropy's slice is gone) and 12 V backward; an entropy
bonus (algo.entropy_coef > 0: the entropy with its gradient, whole) 13 V forward and 9 V backward. Chunked
(`trainer.logprob_chunk_tokens`), each peak is one chunk's: the chunk's forward runs again inside the head's
backward, up to its log-softmax (torch.utils.checkpoint stops a recompute early once the backward's tensors are
made: the metric's entropy is not recomputed); every token keeps 16 bytes of output.

Padding: a micro-batch of rows of unequal length carries transformers' [rows, 1, T, T] boolean sdpa mask, and
every layer's attention keeps its own copy converted to the compute dtype for its backward (aten's
scaled_dot_product_attention turns a boolean mask into an additive one before it picks a kernel, and the kernel's
backward node keeps it): `rows T^2 (1 + layers c)` bytes, quadratic in the length. A micro-batch of one row
needs no mask (sdpa runs causal). With a mask, k and v are kept at the query heads' size (grouped-query sdpa
runs without a mask only). tests/unit/test_step_memory.py finds both in the graph too.
"""

from __future__ import annotations

from typing import Protocol

from colocate.config.algo import GREEDY_TEMPERATURE

FP32 = 4
LOGSOFTMAX_BYTES_PER_VOCAB = 4  # forward: log-softmax's output, beside the logits and their copy
COPY_BYTES_PER_VOCAB = 4  # an fp32 copy (bf16 logits) or the temperature's quotient; fp32 at T=1 makes neither
BACKWARD_BYTES_PER_VOCAB = 12  # log-softmax's saved output, its incoming gradient and its result
NUCLEUS_FORWARD_BYTES_PER_VOCAB = 26  # top_p < 1: sort values + int64 indices, softmax, cumsum, mask, two results
NUCLEUS_BACKWARD_BYTES_PER_VOCAB = 12
ENTROPY_GRAD_BYTES_PER_VOCAB = (13, 9)  # an entropy bonus: forward, backward
ENTROPY_BYTES_PER_VOCAB = 12  # the metric's exp, masked log p and product, 256 positions at a time
ENTROPY_ROWS = 256  # trainer/logprobs.py ENTROPY_ROWS
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


def uses_math_attention(dims: Dims, *, compute_bytes: int, masked: bool, device: str) -> bool:
    """CUDA sdpa runs its math kernel for fp32 grouped-query attention without a mask (the module docstring)."""
    return device == "cuda" and compute_bytes == FP32 and not masked and dims.num_heads != dims.num_kv_heads


def _norm_and_projection(dims: Dims, c: int) -> int:
    """An RMSNorm and the projection after it: the fp32 input and rsqrt, the normalised value, the input."""
    return FP32 * dims.hidden_size + FP32 + 2 * c * dims.hidden_size


def layer_bytes_per_token(dims: Dims, *, compute_bytes: int, masked: bool = False, math_length: int = 0) -> int:
    """What one decoder layer keeps per token for its backward (the table above). `math_length`: the row length
    when attention runs CUDA's math kernel (uses_math_attention), whose softmax output grows with it."""
    c = compute_bytes
    q = dims.num_heads * dims.head_dim
    if math_length:
        attention = c * 4 * q + c * dims.num_heads * math_length
    else:
        kv = q if masked else dims.num_kv_heads * dims.head_dim
        attention = c * (2 * q + 2 * kv) + FP32 * dims.num_heads
    return 2 * _norm_and_projection(dims, c) + attention + 4 * c * dims.intermediate_size


def head_input_bytes_per_token(dims: Dims, *, compute_bytes: int) -> int:
    """The final norm and lm_head's input, and the input ids."""
    return _norm_and_projection(dims, compute_bytes) + 8


def checkpointed_bytes_per_token(dims: Dims, *, compute_bytes: int) -> int:
    """trainer.activation_checkpointing: each layer keeps only its input (the hidden states, in the compute dtype:
    FSDP2 casts the layer's inputs), the final norm and lm_head theirs; a layer's own activations exist only
    while the backward recomputes it (trainer/step_moments.py counts the one being recomputed)."""
    return dims.num_layers * compute_bytes * dims.hidden_size + head_input_bytes_per_token(dims,
                                                                                          compute_bytes=compute_bytes)


def saved_bytes_per_token(dims: Dims, *, compute_bytes: int, masked: bool = False, math_length: int = 0) -> int:
    """Bytes autograd keeps per token through the decoder, for the backward (the table above). `masked`: sdpa
    gets a padding mask, and transformers then repeats k and v to every query head before the kernel
    (integrations/sdpa_attention.py `use_gqa_in_sdpa`: grouped-query sdpa only without a mask), so the kernel
    keeps them that size."""
    layer = layer_bytes_per_token(dims, compute_bytes=compute_bytes, masked=masked, math_length=math_length)
    return dims.num_layers * layer + head_input_bytes_per_token(dims, compute_bytes=compute_bytes)


def rotary_bytes(dims: Dims, *, num_tokens: int, compute_bytes: int) -> int:
    return 2 * compute_bytes * dims.head_dim * num_tokens  # cos and sin, shared by every layer


def logprob_pass_peaks(dims: Dims, *, num_tokens: int, compute_bytes: int, temperature: float, top_p: float,
                       chunk_tokens: int | None, entropy_grad: bool = False) -> tuple[int, int]:
    """(forward, backward) peaks of the log-prob pass over `num_tokens` positions: all at once, or one chunk's
    (trainer.logprob_chunk_tokens: a chunk's forward runs again inside the head's backward, so the backward's
    peak is the larger of the two), plus every token's two fp32 outputs when chunked. The module docstring
    gives each term."""
    if temperature < GREEDY_TEMPERATURE:  # scored as the plain distribution (trainer/logprobs.py)
        temperature, top_p = 1.0, 1.0
    copy = COPY_BYTES_PER_VOCAB if compute_bytes != FP32 or temperature != 1.0 else 0
    # unchunked, the caller holds the model's logits through the pass; a chunk's are the pass's argument alone,
    # freed once copied
    held = compute_bytes if chunk_tokens is None or not copy else 0
    positions = num_tokens if chunk_tokens is None else min(num_tokens, chunk_tokens)
    base = held + copy + LOGSOFTMAX_BYTES_PER_VOCAB
    # after log-softmax: the entropy, 256 positions at a time (or whole, with its gradient); before it, the
    # nucleus's temporaries: whichever is larger
    entropy = positions * ENTROPY_GRAD_BYTES_PER_VOCAB[0] if entropy_grad else \
        ENTROPY_BYTES_PER_VOCAB * min(positions, ENTROPY_ROWS)
    nucleus = positions * NUCLEUS_FORWARD_BYTES_PER_VOCAB if top_p < 1.0 else 0
    forward_bytes = (positions * base + max(entropy, nucleus)) * dims.vocab_size
    # a chunk's recompute stops once it has made what its backward saved (torch.utils.checkpoint's early stop,
    # on by default): the metric's entropy after log-softmax is not recomputed, its gradient's is
    recompute = (positions * base + max(entropy if entropy_grad else 0, nucleus)) * dims.vocab_size
    backward = BACKWARD_BYTES_PER_VOCAB + (NUCLEUS_BACKWARD_BYTES_PER_VOCAB if top_p < 1.0 else 0) \
        + (ENTROPY_GRAD_BYTES_PER_VOCAB[1] if entropy_grad else 0)
    backward_bytes = positions * backward * dims.vocab_size
    outputs = num_tokens * CHUNKED_OUTPUT_BYTES if chunk_tokens is not None else 0
    if chunk_tokens is not None:  # a chunk's forward runs again in the backward
        backward_bytes = max(backward_bytes, recompute)
    return forward_bytes + outputs, backward_bytes + outputs


def attention_mask_bytes(dims: Dims, *, rows: int, length: int, compute_bytes: int,
                         num_layers: int | None = None) -> int:
    """The padded micro-batch's boolean mask and each layer's additive copy of it (`num_layers` copies alive)."""
    return rows * length * length * (1 + (dims.num_layers if num_layers is None else num_layers) * compute_bytes)
