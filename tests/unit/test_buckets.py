"""Bucket planning: layer grouping, slot assignment, alignment, splitting a large layer, too-large tensors; sliced
buckets packed by real bytes (a 1-D tensor is [n, 1]: its rows are 2 bytes, not 64)."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.buckets import (
    ALIGN,
    Run,
    TensorSpec,
    group_by_layer,
    largest_group_bytes,
    largest_layer_bytes,
    plan_buckets,
    plan_sliced_buckets,
)


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


# ---------------------------------------------------------------------------------------------------------------
# Sliced buckets


def run(name: str, num_rows: int, num_cols: int, row_start: int = 0) -> Run:
    return Run(name, row_start, num_rows, num_cols, torch.bfloat16)


def spans(bucket, worker: int) -> list[tuple[str, int, int, int]]:
    """(name, first row, rows, offset) of a worker's regions in a bucket."""
    return [(r.engine_name, r.row_start, r.num_rows, r.offset) for r in bucket.regions[worker]]


def test_one_dimensional_runs_take_their_real_bytes_and_only_starts_are_aligned():
    norms = [run("model.layers.0.input_layernorm.weight", 16, 1),  # 32 bytes each
             run("model.layers.0.post_attention_layernorm.weight", 16, 1)]
    (bucket,) = plan_sliced_buckets([norms], slot_bytes=128, num_slots=2)
    assert spans(bucket, 0) == [("model.layers.0.input_layernorm.weight", 0, 16, 0),
                                ("model.layers.0.post_attention_layernorm.weight", 0, 16, ALIGN)]


def test_a_run_that_does_not_fit_is_split_at_the_most_rows_that_fit():
    first = run("model.layers.0.a.weight", 3, 100)  # 200-byte rows: 600 bytes, fits whole
    second = run("model.layers.0.b.weight", 5, 100)  # starts at 640: 1 row fits in 1024, 4 go on
    buckets = plan_sliced_buckets([[first, second]], slot_bytes=1024, num_slots=2)
    assert [spans(b, 0) for b in buckets] == [
        [("model.layers.0.a.weight", 0, 3, 0), ("model.layers.0.b.weight", 0, 1, 640)],
        [("model.layers.0.b.weight", 1, 4, 1024)],  # slot 1 of the worker's ring
    ]


def test_automatic_slot_holds_each_group_whole_on_every_worker():
    def layer(i: int, rows: int) -> list[Run]:
        p = f"model.layers.{i}."
        return [run(p + "qkv_proj.weight", rows, 24), run(p + "qkv_proj.bias", rows, 1),
                run(p + "down_proj.weight", 24, 7), run(p + "input_layernorm.weight", 24, 1)]

    workers = [layer(0, 12) + layer(1, 12), layer(0, 9) + layer(1, 13)]  # uneven: the largest sets the slot
    slot = largest_group_bytes(workers)
    buckets = plan_sliced_buckets(workers, slot_bytes=slot, num_slots=2)
    assert [b.group for b in buckets] == ["layer.0", "layer.1"]
    for w, runs in enumerate(workers):
        planned = [(n, s, k) for b in buckets for n, s, k, _ in spans(b, w)]
        assert planned == [(r.engine_name, r.row_start, r.num_rows) for r in runs]  # one region per run


def test_row_larger_than_a_slot_names_the_key():
    with pytest.raises(ValueError, match="sync.bucket_mb"):
        plan_sliced_buckets([[run("model.layers.0.a.weight", 2, 100)]], slot_bytes=128, num_slots=2)
