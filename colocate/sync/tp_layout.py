"""The engine's TP layout of Hugging Face weights (Qwen2/Qwen3/Llama families, and their MoE kin), as a pure
function.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, splits column-parallel weights on dim 0 and
row-parallel ones (o_proj, down_proj) on dim 1, and pads the vocabulary of embeddings and lm_head to a
multiple of 64 before splitting it. Routed experts live in two fused tensors per layer (w13, w2), holding the
worker's experts (all, or its expert-parallel block) with their intermediate dimension split by TP.
`engine_tensor` computes, from full HF tensors, exactly what one TP worker must hold; verification compares every
engine parameter with it.

    expected = engine_tensor("model.layers.0.self_attn.qkv_proj.weight", hf_state, TPLayout(rank, size, ...))
    # vocabulary-parallel tensors: compare only the first expected.shape[0] rows (the rest is padding)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class ExpertLayout:
    """How one engine worker holds a model's routed experts, as the worker reports it (vLLM's FusedMoE layer):
    `expert_ids[j]` is the global expert in its local slot j (its expert map, inverted: all of them without
    expert parallelism, a block of them with it), and each expert's intermediate dimension is split `tp_size` ways
    (the engine's TP without expert parallelism, 1 with it)."""

    tp_rank: int
    tp_size: int
    expert_ids: tuple[int, ...]


@dataclass(frozen=True)
class TPLayout:
    tp_rank: int
    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    experts: ExpertLayout | None = None  # None: a dense model

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


# A LoRA job's adapter tensors, under PEFT's names: `<module>.lora_A.weight` [rank, in], `.lora_B.weight` [out, rank]
ADAPTER_LEAVES = (".lora_A.weight", ".lora_B.weight")
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # their rows split by TP (o/down: columns)


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_LEAVES)


def _adapter_tensor(name: str, hf: dict[str, torch.Tensor], layout: TPLayout) -> torch.Tensor:
    """vLLM's LoRA layers (vllm/lora/layers): a column-parallel layer holds all of A and its TP rows of B (k and v
    by KV head, like their weights), a row-parallel one (o, down) its TP columns of A and all of B. An engine
    buffer may hold more rank than the adapter (engine.max_lora_rank): compare its first rows (A; the rest must
    be zero, compare_engine_state); B arrives padded by the trainer."""
    module = name[: -len(".lora_A.weight")]
    projection, matrix = module.rpartition(".")[2], name[-len("lora_A.weight"):-len(".weight")]
    full = hf[name]
    if matrix == "lora_B" and projection in ("k_proj", "v_proj"):
        return _kv_rows(full, layout)
    if matrix == "lora_B" and projection in COLUMN_PARALLEL:
        return _rows(full, layout.tp_rank, layout.tp_size)
    if matrix == "lora_A" and projection not in COLUMN_PARALLEL:
        return _rows(full.t(), layout.tp_rank, layout.tp_size).t()
    return full


def engine_tensor(name: str, hf: dict[str, torch.Tensor], layout: TPLayout) -> torch.Tensor:
    """What TP worker `layout.tp_rank` holds under engine parameter `name`, built from full HF tensors."""
    if is_adapter(name):
        return _adapter_tensor(name, hf, layout)
    prefix, _, leaf = name.rpartition(".")  # leaf: weight or bias
    if leaf in EXPERT_LEAVES and layout.experts is not None:
        return _expert_tensor(prefix, leaf, hf, layout.experts)
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


# vLLM's fused expert tensors and the Hugging Face tensors they come from (transformers 5 fuses experts too):
# w13_weight [E_local, 2 * I / tp, H] = per expert [gate rows of this rank | up rows], from gate_up_proj [E, 2I, H];
# w2_weight [E_local, H, I / tp] = this rank's columns of down_proj [E, H, I].
EXPERT_LEAVES = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def hf_experts_name(prefix: str, leaf: str) -> str:
    """The HF tensor of engine expert parameter `prefix.leaf` (vLLM may nest the layer in a `routed_experts`
    runner: model.layers.0.mlp.experts.routed_experts.w13_weight <- model.layers.0.mlp.experts.gate_up_proj)."""
    return f"{prefix.removesuffix('.routed_experts')}.{EXPERT_LEAVES[leaf]}"


def _expert_tensor(prefix: str, leaf: str, hf: dict[str, torch.Tensor], experts: ExpertLayout) -> torch.Tensor:
    full = hf[hf_experts_name(prefix, leaf)][list(experts.expert_ids)]  # this worker's experts, in slot order
    if leaf == "w2_weight":
        return full.chunk(experts.tp_size, dim=2)[experts.tp_rank]
    gate, up = full.chunk(2, dim=1)
    return torch.cat([gate.chunk(experts.tp_size, dim=1)[experts.tp_rank],
                      up.chunk(experts.tp_size, dim=1)[experts.tp_rank]], dim=1)


def compare_engine_state(engine_state: dict[str, torch.Tensor], hf: dict[str, torch.Tensor],
                         layout: TPLayout) -> list[str]:
    """Names of engine parameters that differ from the trainer's weights (empty: bit-for-bit equal)."""
    mismatched = []
    for name, actual in engine_state.items():
        if is_adapter(name) and name not in hf:  # a sub-layer the adapter leaves out (q_proj's k and v): zeros
            if actual.count_nonzero():
                mismatched.append(name)
            continue
        expected = engine_tensor(name, hf, layout)
        # vocabulary padding rows, and an adapter's A rows past the trainer's rank, are not the trainer's; those A
        # rows must be zero, as vLLM computes with the whole buffer (a stale page there: engine/lora.py)
        actual, extra = actual[: expected.shape[0]], actual[expected.shape[0]:]
        if actual.shape != expected.shape or not torch.equal(actual, expected.to(actual.dtype)) or \
                (is_adapter(name) and extra.count_nonzero()):
            mismatched.append(name)
    return mismatched
