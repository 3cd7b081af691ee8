"""The sliced ring plan on real 7B/8B model shapes, built from shapes alone (nothing allocated): with automatic
slots every layer group is one bucket holding one region per engine parameter; with small slots each bucket
boundary splits at most one run, and no region is tiny unless its tensor is (norms, biases). Every region is a
copy kernel and a checksum per sync, so the region count is what these tests bound."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from colocate.sync.buckets import ALIGN, TensorSpec, layer_group
from colocate.sync.reshard import build_sync_plan
from colocate.sync.tp_layout import VOCAB_PADDING, TPLayout
from tests.unit.test_reshard import HD, INTER, NKV, NQ, H, engine_shapes, hf_state

MIB = 1 << 20
SMALL_REGION = 4096  # under this a region's copy is all launch overhead


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    qkv_bias: bool
    head_dim: int = 0  # 0: hidden // num_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    def layout(self, tp_rank: int, tp_size: int) -> TPLayout:
        return TPLayout(tp_rank, tp_size, self.num_heads, self.num_kv_heads, self.hd, self.vocab)


LLAMA3_8B = Dims(4096, 14336, 32, 32, 8, 128256, qkv_bias=False)
QWEN25_7B = Dims(3584, 18944, 28, 28, 4, 152064, qkv_bias=True)
# A small vocabulary: a decoder layer, not the embeddings, sets the automatic slot, so the layer fills it to the
# byte (the case where aligning each row of a norm, [4096, 1], left its rows no room and splintered them).
LLAMA2_7B = Dims(4096, 11008, 32, 32, 32, 32000, qkv_bias=False)
SMALL = Dims(H, INTER, 2, NQ, NKV, 48, qkv_bias=True, head_dim=HD)  # test_reshard's model, for the cross-check


def hf_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """The trainer's (HF) tensor shapes, untied, in checkpoint order."""
    shapes = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", d.num_heads * d.hd), ("k", d.num_kv_heads * d.hd), ("v", d.num_kv_heads * d.hd)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, d.hidden)
            if d.qkv_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes.update({
            p + "self_attn.o_proj.weight": (d.hidden, d.num_heads * d.hd),
            p + "mlp.gate_proj.weight": (d.intermediate, d.hidden),
            p + "mlp.up_proj.weight": (d.intermediate, d.hidden),
            p + "mlp.down_proj.weight": (d.hidden, d.intermediate),
            p + "input_layernorm.weight": (d.hidden,), p + "post_attention_layernorm.weight": (d.hidden,),
        })
    shapes["model.norm.weight"] = (d.hidden,)
    shapes["lm_head.weight"] = (d.vocab, d.hidden)
    return shapes


def engine_params(d: Dims, tp_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM's parameter names and shapes on one TP worker (the same on every rank), in its module order."""
    vocab_rows = -(-d.vocab // VOCAB_PADDING) * VOCAB_PADDING // tp_size
    qkv_rows = (d.num_heads // tp_size + 2 * max(1, d.num_kv_heads // tp_size)) * d.hd  # KV heads replicated
    out = [("model.embed_tokens.weight", (vocab_rows, d.hidden))]
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        out.append((p + "self_attn.qkv_proj.weight", (qkv_rows, d.hidden)))
        if d.qkv_bias:
            out.append((p + "self_attn.qkv_proj.bias", (qkv_rows,)))
        out += [(p + "self_attn.o_proj.weight", (d.hidden, d.num_heads * d.hd // tp_size)),
                (p + "mlp.gate_up_proj.weight", (2 * d.intermediate // tp_size, d.hidden)),
                (p + "mlp.down_proj.weight", (d.hidden, d.intermediate // tp_size)),
                (p + "input_layernorm.weight", (d.hidden,)), (p + "post_attention_layernorm.weight", (d.hidden,))]
    return out + [("model.norm.weight", (d.hidden,)), ("lm_head.weight", (vocab_rows, d.hidden))]


def sync_plan(d: Dims, tp_size: int, *, bucket_bytes: int):
    specs = [TensorSpec(n, s, torch.bfloat16) for n, s in hf_shapes(d).items()]
    params = [(n, s, "torch.bfloat16") for n, s in engine_params(d, tp_size)]
    layouts = [{"tp_rank": r, "tp_size": tp_size, "params": params} for r in range(tp_size)]
    plan = build_sync_plan(specs, layouts, d.layout, bucket_bytes=bucket_bytes, num_slots=2)
    assert plan.mode == "sliced"
    return plan


def params_per_group(d: Dims, tp_size: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, _ in engine_params(d, tp_size):
        counts[layer_group(name)] = counts.get(layer_group(name), 0) + 1
    return counts


@pytest.mark.parametrize("tp_size", [1, 2, 4], ids=lambda t: f"tp{t}")
def test_shape_only_engine_params_match_the_layout_from_tensors(tp_size):
    hf = hf_state(SMALL.vocab, tied=False)
    assert hf_shapes(SMALL) == {n: tuple(t.shape) for n, t in hf.items()}
    for rank in range(tp_size):
        assert engine_params(SMALL, tp_size) == engine_shapes(hf, SMALL.layout(rank, tp_size), tied=False)


MODELS = [pytest.param(LLAMA3_8B, id="llama3_8b"), pytest.param(QWEN25_7B, id="qwen2.5_7b"),
          pytest.param(LLAMA2_7B, id="llama2_7b")]
TP_SIZES = pytest.mark.parametrize("tp_size", [2, 4], ids=lambda t: f"tp{t}")


@pytest.mark.parametrize("dims", MODELS)
@TP_SIZES
def test_automatic_slots_hold_each_layer_group_as_one_bucket_of_whole_parameters(dims, tp_size):
    plan = sync_plan(dims, tp_size, bucket_bytes=0)
    groups = ["pre"] + [f"layer.{i}" for i in range(dims.num_layers)] + ["post"]
    assert [b.group for b in plan.buckets] == groups
    per_group = params_per_group(dims, tp_size)
    for bucket in plan.buckets:
        for regions in bucket.regions:
            assert 0 < len(regions) <= per_group[bucket.group]
            assert len({r.engine_name for r in regions}) == len(regions)  # no parameter split


@pytest.mark.parametrize("dims", MODELS)
@TP_SIZES
def test_small_slots_split_at_most_one_run_per_bucket_boundary_and_never_into_slivers(dims, tp_size):
    plan = sync_plan(dims, tp_size, bucket_bytes=64 * MIB)
    params = engine_params(dims, tp_size)
    whole_bytes = {n: torch.Size(s).numel() * 2 for n, s in params}
    for worker in range(tp_size):
        regions = [(b, r) for b in plan.buckets for r in b.regions[worker]]
        assert len(regions) <= len(params) + len(plan.buckets)
        for bucket, r in regions:
            slot_start = bucket.slot * plan.slot_bytes
            assert (r.offset - slot_start) % ALIGN == 0
            assert slot_start <= r.offset and r.offset + r.num_bytes <= slot_start + plan.slot_bytes
            assert r.num_bytes >= min(SMALL_REGION, whole_bytes[r.engine_name]), (r.engine_name, r.num_bytes)
