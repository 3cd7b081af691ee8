"""The activation model (trainer/step_memory.py) against what autograd really keeps: a real transformers Qwen2
(random weights, sdpa) runs a forward, and every tensor saved in its backward graph (found by walking the graph's
nodes, parameters left out, each storage once) adds up to exactly the model's bytes, in fp32 and in bf16, with
grouped-query attention and a head_dim that is not hidden / heads. The full train step's peak, logits included,
is checked against a measured one by `colocate bench train-memory` (benchmarks/results/train_memory.json) and
tests/unit/test_step_moments.py; the log-prob pass's peaks are measured here with torch's MemTracker."""

from __future__ import annotations

import pytest
import torch

from colocate.job.preflight import ModelDims
from colocate.trainer.step_memory import (
    attention_mask_bytes,
    rotary_bytes,
    saved_bytes_per_token,
)

CONFIGS = {
    "qwen2-gqa": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000),
    "qwen2-mha-3-layers": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
                               num_key_value_heads=6, vocab_size=1000),
}


def saved_tensor_bytes(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
    """Bytes of every distinct storage that the backward graph of a forward keeps, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    root = model(input_ids=input_ids, attention_mask=attention_mask).logits.grad_fn
    seen, stack, visited = {}, [root], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            value = getattr(node, name)
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in parameters:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_saved_activations_are_exactly_what_autograd_keeps(name, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**CONFIGS[name], attn_implementation="sdpa", max_position_embeddings=1024)
    model = Qwen2ForCausalLM(config).to(dtype)
    dims = ModelDims.from_config_dict(config.to_dict())
    tokens = 96
    measured = saved_tensor_bytes(model, torch.randint(0, config.vocab_size, (1, tokens)))
    c = 2 if dtype == torch.bfloat16 else 4
    predicted = tokens * saved_bytes_per_token(dims, compute_bytes=c) + rotary_bytes(dims, num_tokens=tokens,
                                                                                      compute_bytes=c)
    assert predicted == measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_padded_micro_batch_keeps_a_mask_per_layer(dtype):
    """Two rows, the second padded: every layer's attention keeps its own additive copy of the [rows, 1, T, T]
    mask (the boolean one itself is not kept for the backward: only the copies count here), and k and v
    repeated to the query heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**CONFIGS["qwen2-gqa"], attn_implementation="sdpa", max_position_embeddings=1024)
    model = Qwen2ForCausalLM(config).to(dtype)
    dims = ModelDims.from_config_dict(config.to_dict())
    rows, tokens, c = 2, 64, 2 if dtype == torch.bfloat16 else 4
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[1, 50:] = 0
    padded = saved_tensor_bytes(model, torch.randint(0, config.vocab_size, (rows, tokens)), mask)
    unpadded = saved_tensor_bytes(model, torch.randint(0, config.vocab_size, (rows, tokens)))
    bool_mask = rows * tokens * tokens
    repeated_kv = rows * tokens * (saved_bytes_per_token(dims, compute_bytes=c, masked=True)
                                   - saved_bytes_per_token(dims, compute_bytes=c))
    assert repeated_kv == rows * tokens * dims.num_layers * c * 2 * (4 - 2) * 64  # 4 heads, not 2, for k and v
    assert padded - unpadded == attention_mask_bytes(dims, rows=rows, length=tokens, compute_bytes=c) - bool_mask \
        + repeated_kv


# ------------------------------------------------------------------------------------------ the log-prob pass


def tracked_peaks(fn_forward, fn_backward) -> tuple[int, int]:
    """Peaks of live tensor bytes (torch's MemTracker: every storage an op returns, until it is freed) during a
    forward and during the backward after it, each over what was live before the forward."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        device = torch.device("cpu")
        before = tracker.get_tracker_snapshot().get(device, {}).get("Total", 0)
        out = fn_forward()
        forward = tracker.get_tracker_snapshot("peak")[device]["Total"] - before
        tracker._peak_mem = {device: 0}  # the backward's own peak from here
        fn_backward(out)
        backward = tracker.get_tracker_snapshot("peak")[device]["Total"] - before
    return forward, backward


@pytest.mark.parametrize("dtype, temperature, top_p, chunked, entropy_grad", [
    (torch.bfloat16, 1.0, 1.0, False, False), (torch.float32, 1.0, 1.0, False, False),
    (torch.float32, 0.7, 1.0, False, False), (torch.bfloat16, 0.7, 1.0, True, False),
    (torch.float32, 1.0, 1.0, True, False), (torch.bfloat16, 1.0, 0.9, False, False),
    (torch.float32, 1.0, 0.9, True, False), (torch.bfloat16, 1.0, 1.0, False, True),
], ids=["bf16", "fp32", "fp32_temperature", "bf16_temperature_chunk", "fp32_chunk", "bf16_nucleus",
        "fp32_nucleus_chunk", "bf16_entropy_bonus"])
def test_the_log_prob_pass_peaks_are_what_its_tensors_hold(dtype, temperature, top_p, chunked, entropy_grad):
    """processed_logprobs over one chunk of positions, measured: unchunked the caller holds the model's logits
    through the pass (sequence_logprobs), a chunk's logits are the pass's argument alone (ChunkedLogprobHead)."""
    from colocate.trainer.logprobs import processed_logprobs
    from colocate.trainer.step_memory import logprob_pass_peaks

    positions, vocab, hidden = 1024, 4096, 64
    dims = ModelDims.from_config_dict({**CONFIGS["qwen2-gqa"], "vocab_size": vocab})
    torch.manual_seed(0)
    h = torch.randn(positions, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,))
    held = []

    def forward():
        if chunked:  # called as ChunkedLogprobHead._chunk calls it: the logits are the callee's alone
            return processed_logprobs(torch.nn.functional.linear(h, w), targets, temperature=temperature,
                                      top_p=top_p, entropy_grad=entropy_grad)
        held.append(torch.nn.functional.linear(h, w))
        return processed_logprobs(held[0], targets, temperature=temperature, top_p=top_p, entropy_grad=entropy_grad)

    def backward(out):
        held.clear()
        (out[0].sum() + (out[1].sum() if entropy_grad else 0)).backward()

    forward_peak, backward_peak = tracked_peaks(forward, backward)
    c = 2 if dtype == torch.bfloat16 else 4
    weight_grad = vocab * hidden * c  # the head's gradient: lm_head's, counted in its own moment
    forward, _ = logprob_pass_peaks(dims, num_tokens=positions, compute_bytes=c, temperature=temperature,
                                    top_p=top_p, chunk_tokens=positions if chunked else None,
                                    entropy_grad=entropy_grad)
    forward -= positions * 16 if chunked else 0  # the chunked head's outputs, not this bare pass's
    # chunked, the model adds the chunk's recompute to the backward; this bare pass has none
    _, backward = logprob_pass_peaks(dims, num_tokens=positions, compute_bytes=c, temperature=temperature,
                                     top_p=top_p, chunk_tokens=None, entropy_grad=entropy_grad)
    assert abs(forward_peak - forward) <= 0.05 * forward_peak, (forward_peak, forward)
    assert abs(backward_peak - weight_grad - backward) <= 0.05 * backward_peak, (backward_peak, backward)
