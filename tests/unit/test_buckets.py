"""Bucket planning: layer grouping, slot assignment, alignment, splitting a large layer, too-large tensors."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.buckets import ALIGN, TensorSpec, group_by_layer, largest_layer_bytes, plan_buckets


def spec(name: str, *shape: int, dtype=torch.bfloat16) -> TensorSpec:
    return TensorSpec(name, tuple(shape), dtype)


SPECS = [
    spec("model.embed_tokens.weight", 48, 16),
    spec("model.layers.0.self_attn.q_proj.weight", 16, 16),
    spec("model.layers.0.mlp.down_proj.weight", 16, 40),
    spec("model.layers.10.input_layernorm.weight", 16),
    spec("model.layers.2.input_layernorm.weight", 16),
    spec("model.norm.weight", 16),
    spec("lm_head.weight", 48, 16),
]


def test_groups_in_model_order_with_numeric_layer_order():
    assert [g for g, _ in group_by_layer(SPECS)] == ["pre", "layer.0", "layer.2", "layer.10", "post"]


def test_one_bucket_per_layer_when_slots_hold_the_largest_layer():
    slot = largest_layer_bytes(SPECS)
    buckets = plan_buckets(group_by_layer(SPECS), slot_bytes=slot, num_slots=2)
    assert [b.group for b in buckets] == ["pre", "layer.0", "layer.2", "layer.10", "post"]
    assert [b.slot for b in buckets] == [0, 1, 0, 1, 0]
    for b in buckets:
        for t in b.tensors:
            assert t.offset % ALIGN == 0
            assert b.slot * slot <= t.offset and t.offset + t.spec.num_bytes <= (b.slot + 1) * slot


def test_tensors_in_a_bucket_do_not_overlap():
    buckets = plan_buckets(group_by_layer(SPECS), slot_bytes=4096, num_slots=3)
    for b in buckets:
        spans = sorted((t.offset, t.offset + t.spec.num_bytes) for t in b.tensors)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_layer_larger_than_a_slot_is_split_into_buckets_of_one_group():
    layer = [spec(f"model.layers.0.mlp.w{i}.weight", 32, 32) for i in range(4)]  # 2 KiB each
    buckets = plan_buckets(group_by_layer(layer), slot_bytes=4096, num_slots=2)
    assert len(buckets) == 2 and all(b.group == "layer.0" for b in buckets)
    assert sum(len(b.tensors) for b in buckets) == 4


def test_every_tensor_is_planned_exactly_once():
    buckets = plan_buckets(group_by_layer(SPECS), slot_bytes=2048, num_slots=2)
    names = [t.spec.name for b in buckets for t in b.tensors]
    assert sorted(names) == sorted(s.name for s in SPECS)


def test_tensor_larger_than_a_slot_names_the_key():
    with pytest.raises(ValueError, match="sync.bucket_mb"):
        plan_buckets(group_by_layer(SPECS), slot_bytes=512, num_slots=2)
