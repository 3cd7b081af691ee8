"""The engine's TP layout of Hugging Face weights (Qwen2/Qwen3/Llama families), as a pure function.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, splits column-parallel weights on dim 0 and
row-parallel ones (o_proj, down_proj) on dim 1, and pads the vocabulary of embeddings and lm_head to a
multiple of 64 before splitting it. `engine_tensor` computes, from full HF tensors, exactly what one TP worker
must hold; verification compares every engine parameter with it.

    expected = engine_tensor("model.layers.0.self_attn.qkv_proj.weight", hf_state, TPLayout(rank, size, ...))
    # vocabulary-parallel tensors: compare only the first expected.shape[0] rows (the rest is padding)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class TPLayout:
    tp_rank: int
    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config, *, tp_rank: int, tp_size: int) -> TPLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(tp_rank, tp_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.vocab_size)


def _rows(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    size = tensor.shape[0] // count
    return tensor[index * size:(index + 1) * size]


def _kv_rows(tensor: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    if layout.num_kv_heads >= layout.tp_size:
        return _rows(tensor, layout.tp_rank, layout.tp_size)
    # Fewer KV heads than TP ranks: each head is replicated on tp_size / num_kv_heads ranks.
    head = layout.tp_rank * layout.num_kv_heads // layout.tp_size
    return tensor[head * layout.head_dim:(head + 1) * layout.head_dim]


def _vocab_rows(tensor: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    padded = -(-layout.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = padded // layout.tp_size
    return tensor[layout.tp_rank * per_rank:(layout.tp_rank + 1) * per_rank]  # may be short: padding rows


def engine_tensor(name: str, hf: dict[str, torch.Tensor], layout: TPLayout) -> torch.Tensor:
    """What TP worker `layout.tp_rank` holds under engine parameter `name`, built from full HF tensors."""
    prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
    if prefix.endswith("qkv_proj"):
        base = prefix[: -len("qkv_proj")]
        return torch.cat([
            _rows(hf[f"{base}q_proj.{leaf}"], layout.tp_rank, layout.tp_size),
            _kv_rows(hf[f"{base}k_proj.{leaf}"], layout),
            _kv_rows(hf[f"{base}v_proj.{leaf}"], layout),
        ])
    if prefix.endswith("gate_up_proj"):
        base = prefix[: -len("gate_up_proj")]
        return torch.cat([_rows(hf[f"{base}gate_proj.{leaf}"], layout.tp_rank, layout.tp_size),
                          _rows(hf[f"{base}up_proj.{leaf}"], layout.tp_rank, layout.tp_size)])
    if prefix.endswith(("o_proj", "down_proj")) and leaf == "weight":
        return _rows(hf[name].t(), layout.tp_rank, layout.tp_size).t()
    if prefix.endswith(("embed_tokens", "lm_head")):
        source = hf.get(name, hf.get("model.embed_tokens.weight"))  # lm_head tied to the embeddings
        return _vocab_rows(source, layout)
    return hf[name]  # replicated: norms, o_proj/down_proj bias


def compare_engine_state(engine_state: dict[str, torch.Tensor], hf: dict[str, torch.Tensor],
                         layout: TPLayout) -> list[str]:
    """Names of engine parameters that differ from the trainer's weights (empty: bit-for-bit equal)."""
    mismatched = []
    for name, actual in engine_state.items():
        expected = engine_tensor(name, hf, layout)
        actual = actual[: expected.shape[0]]  # vocabulary padding rows are not the trainer's
        if actual.shape != expected.shape or not torch.equal(actual, expected.to(actual.dtype)):
            mismatched.append(name)
    return mismatched
