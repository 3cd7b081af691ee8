"""The activation model (trainer/step_memory.py) against what autograd really keeps: a real transformers Qwen2
(random weights, sdpa) runs a forward, and every tensor saved in its backward graph (found by walking the graph's
nodes, parameters left out, each storage once) adds up to exactly the model's bytes, in fp32 and in bf16, with
grouped-query attention and a head_dim that is not hidden / heads. The full train step's peak, logits included,
is checked against a measured one by `colocate bench train-memory` (benchmarks/results/train_memory.json)."""

from __future__ import annotations

import pytest
import torch

from colocate.job.preflight import ModelDims
from colocate.trainer.step_memory import (
    attention_mask_bytes,
    layer_bytes_per_token,
    micro_batch_parts,
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


def test_micro_batch_parts_scale_with_tokens_and_count_the_nucleus_and_the_mask():
    dims = ModelDims.from_config_dict({**CONFIGS["qwen2-gqa"]})
    one = micro_batch_parts(dims, num_tokens=1000, micro_batch_size=1, compute_bytes=4, temperature=0.9, top_p=1.0)
    two = micro_batch_parts(dims, num_tokens=2000, micro_batch_size=2, compute_bytes=4, temperature=0.9, top_p=1.0)
    assert "attention masks" not in one and two["attention masks"] == 2 * 1000 * 1000 * (1 + 2 * 4)
    assert two["logits and log-softmax"] == 2 * one["logits and log-softmax"] == 2 * 1000 * 16 * 1000
    nucleus = micro_batch_parts(dims, num_tokens=1000, micro_batch_size=1, compute_bytes=4, temperature=0.9, top_p=0.9)
    assert nucleus["logits and log-softmax"] == 1000 * (16 + 17) * 1000


def test_the_chunked_log_prob_pass_holds_one_chunk_of_logits():
    dims = ModelDims.from_config_dict({**CONFIGS["qwen2-gqa"]})
    full = micro_batch_parts(dims, num_tokens=4000, micro_batch_size=1, compute_bytes=4, temperature=0.9, top_p=0.9)
    chunked = micro_batch_parts(dims, num_tokens=4000, micro_batch_size=1, compute_bytes=4, temperature=0.9, top_p=0.9,
                                chunk_tokens=1000)
    per_token = (4 + 12 + 17) * dims.vocab_size
    assert full["logits and log-softmax"] == 4000 * per_token
    assert chunked["logits and log-softmax"] == 1000 * per_token + 4000 * 16
    assert chunked["activations kept for backward"] == full["activations kept for backward"]
    short = micro_batch_parts(dims, num_tokens=500, micro_batch_size=1, compute_bytes=4, temperature=0.9, top_p=0.9,
                              chunk_tokens=1000)
    assert short["logits and log-softmax"] == 500 * per_token + 500 * 16


def test_fp32_logits_at_temperature_1_are_not_copied_and_the_recompute_follows_the_log_prob_pass():
    dims = ModelDims.from_config_dict({**CONFIGS["qwen2-gqa"]})
    tokens, vocab = 1000, dims.vocab_size

    def logits(c, t):
        return micro_batch_parts(dims, num_tokens=tokens, micro_batch_size=1, compute_bytes=c, temperature=t,
                                 top_p=1.0)["logits and log-softmax"]

    # logits.float() of fp32 logits is the logits themselves; a temperature or bf16 logits make a copy
    assert logits(4, 1.0) == tokens * (4 + 8) * vocab
    assert logits(4, 0.7) == logits(4, 1e-6) + tokens * 4 * vocab == tokens * (4 + 12) * vocab
    assert logits(4, 1e-6) == logits(4, 1.0)  # greedy: scored as the plain distribution
    assert logits(2, 1.0) == tokens * (2 + 12) * vocab
    # checkpointed: the peak is the larger of the log-prob pass and what the layers' recompute holds after it
    plain = micro_batch_parts(dims, num_tokens=tokens, micro_batch_size=1, compute_bytes=4, temperature=1.0,
                              top_p=1.0, checkpointed=True)
    recompute = tokens * layer_bytes_per_token(dims, compute_bytes=4, masked=False)
    after = tokens * 4 * vocab + recompute  # the logits stay, the pass's temporaries are gone
    assert plain["one layer recomputed"] == max(0, after - plain["logits and log-softmax"])
    chunked = micro_batch_parts(dims, num_tokens=tokens, micro_batch_size=1, compute_bytes=4, temperature=1.0,
                                top_p=1.0, checkpointed=True, chunk_tokens=100)
    assert sum(chunked.values()) == chunked["activations kept for backward"] + max(
        chunked["logits and log-softmax"], tokens * 16 + recompute)
