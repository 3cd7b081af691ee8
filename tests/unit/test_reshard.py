"""The reshard plan (pieces) against the independent full-tensor layout (plan.engine_tensor): applying the pieces
to full HF tensors gives exactly what each TP worker holds, for TP 1/2/4, replicated KV heads, tied and padded
vocabularies; and sliced buckets cover every piece once. (tests/e2e checks both against vLLM's real shapes.)"""

from __future__ import annotations

import math

import pytest
import torch

from colocate.sync.buckets import TensorSpec
from colocate.sync.reshard import as_2d, build_sync_plan, plan_pieces, runs_for_worker
from colocate.sync.tp_layout import VOCAB_PADDING, TPLayout, engine_tensor

H, NQ, NKV, HD, INTER = 64, 4, 2, 16, 96


def hf_state(vocab: int, tied: bool, num_layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, H)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (NQ * HD, H), p + "self_attn.q_proj.bias": (NQ * HD,),
            p + "self_attn.k_proj.weight": (NKV * HD, H), p + "self_attn.k_proj.bias": (NKV * HD,),
            p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.v_proj.bias": (NKV * HD,),
            p + "self_attn.o_proj.weight": (H, NQ * HD),
            p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
            p + "mlp.down_proj.weight": (H, INTER),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def engine_shapes(hf: dict, layout: TPLayout, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM's parameter names and shapes for one worker (what colocate_param_layout reports)."""
    names = ["model.embed_tokens.weight"]
    for name in hf:
        if ".layers." in name:
            if "q_proj" in name:
                names.append(name.replace("q_proj", "qkv_proj"))
            elif "gate_proj" in name:
                names.append(name.replace("gate_proj", "gate_up_proj"))
            elif not any(k in name for k in ("k_proj", "v_proj", "up_proj")):
                names.append(name)
    names.append("model.norm.weight")
    if not tied:
        names.append("lm_head.weight")
    padded = -(-layout.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    out = []
    for name in names:
        shape = tuple(engine_tensor(name, hf, layout).shape)
        if "embed_tokens" in name or "lm_head" in name:
            shape = (padded // layout.tp_size, H)
        out.append((name, shape))
    return out


def apply_pieces(pieces, shapes, hf) -> dict[str, torch.Tensor]:
    out = {name: torch.full(shape, float("nan")) for name, shape in shapes}
    for p in pieces:
        target = out[p.engine_name].view(*as_2d(out[p.engine_name].shape))
        source = hf[p.hf_name].reshape(as_2d(hf[p.hf_name].shape))
        target[p.dst_row:p.dst_row + p.num_rows] = source[p.src_row:p.src_row + p.num_rows,
                                                          p.src_col:p.src_col + p.num_cols]
    return out


@pytest.mark.parametrize("tp_size", [1, 2, 4], ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("vocab, tied", [pytest.param(48, False, id="padded_vocab"),
                                         pytest.param(256, True, id="tied_embeddings"),
                                         pytest.param(130, False, id="vocab_spills_to_a_padded_shard")])
def test_pieces_reproduce_each_workers_tensors(tp_size, vocab, tied):
    hf = hf_state(vocab, tied)
    for rank in range(tp_size):
        layout = TPLayout(rank, tp_size, NQ, NKV, HD, vocab)
        shapes = engine_shapes(hf, layout, tied)
        pieces = plan_pieces(shapes, {n: tuple(t.shape) for n, t in hf.items()}, layout)
        assert pieces is not None
        built = apply_pieces(pieces, shapes, hf)
        for name, _ in shapes:
            expected = engine_tensor(name, hf, layout)
            assert torch.equal(built[name][: expected.shape[0]], expected), (rank, name)
            # rows beyond the vocabulary (padding) are never written
            assert torch.isnan(built[name][expected.shape[0]:]).all()


def test_unknown_parameter_means_no_plan():
    hf = hf_state(48, False)
    layout = TPLayout(0, 1, NQ, NKV, HD, 48)
    shapes = engine_shapes(hf, layout, False) + [("model.layers.0.mlp.experts.w13_weight", (8, H))]
    assert plan_pieces(shapes, {n: tuple(t.shape) for n, t in hf.items()}, layout) is None


def test_sliced_buckets_cover_every_run_once_and_split_large_tensors():
    hf = hf_state(48, False)
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in hf.items()]
    layouts = []
    for rank in range(2):
        layout = TPLayout(rank, 2, NQ, NKV, HD, 48)
        layouts.append({"tp_rank": rank, "tp_size": 2,
                        "params": [(n, s, "torch.bfloat16") for n, s in engine_shapes(hf, layout, False)]})
    make_layout = lambda r, s: TPLayout(r, s, NQ, NKV, HD, 48)  # noqa: E731
    small = build_sync_plan(specs, layouts, make_layout, bucket_bytes=2048, num_slots=2)  # < gate_up (6 KiB)
    assert small.mode == "sliced" and all(len(b.regions) == 2 for b in small.buckets)
    for rank in range(2):
        params = [(n, tuple(s), torch.bfloat16) for n, s, _ in layouts[rank]["params"]]
        runs = runs_for_worker(params, [p for ps in small.pieces[rank].values() for p in ps])
        covered = {}
        for bucket in small.buckets:
            for region in bucket.regions[rank]:
                start = bucket.slot * 2048  # within the worker's own ring
                assert start <= region.offset and region.offset + region.num_bytes <= start + 2048
                covered.setdefault(region.engine_name, []).append((region.row_start, region.num_rows))
        for run in runs:
            rows = sorted(covered[run.engine_name])
            assert sum(n for _, n in rows) == run.num_rows  # split by rows, nothing twice, nothing missing
    assert len(small.buckets) > len(build_sync_plan(specs, layouts, make_layout, bucket_bytes=0,
                                                    num_slots=2).buckets)


def test_in_place_plan_addresses_each_workers_parameters_and_needs_no_ring():
    """In place, a region's offset is its parameter's offset in the worker's arena plus its first row: the
    regions of a worker tile exactly the bytes the trainer writes, inside each parameter, with no ring."""
    hf = hf_state(48, True)
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in hf.items()]
    layouts, offsets = [], []
    for rank in range(2):
        layout = TPLayout(rank, 2, NQ, NKV, HD, 48)
        params = [(n, s, "torch.bfloat16") for n, s in engine_shapes(hf, layout, True)]
        layouts.append({"tp_rank": rank, "tp_size": 2, "params": params})
        start, worker_offsets = 0, {}
        for name, shape, _ in params:  # as WeightArena lays them out
            worker_offsets[name] = start
            start += (math.prod(shape) * 2 + 63) // 64 * 64
        offsets.append(worker_offsets)
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, 48), bucket_bytes=0,
                           num_slots=2, param_offsets=offsets)
    assert plan.in_place and plan.ring_bytes == 0 and plan.mode == "sliced"
    assert [b.group for b in plan.buckets] == ["pre", "layer.0", "layer.1", "post"]
    for rank in range(2):
        shapes = {n: s for n, s, _ in layouts[rank]["params"]}
        written = sorted((r.offset, r.offset + r.num_bytes, r.engine_name) for b in plan.buckets
                         for r in b.regions[rank])
        for (_, end, _), (start, _, _) in zip(written, written[1:]):
            assert end <= start  # nothing written twice
        for start, end, name in written:
            first = offsets[rank][name]
            assert first <= start and end <= first + math.prod(shapes[name]) * 2  # inside its parameter
        # every parameter's rows are written, except the vocabulary padding (48 rows padded to 64 for TP=2: rank
        # 1 holds rows 32..63, 16 of them padding); the tied lm_head is the embedding's parameter, not listed
        padding_rows = 32 - min(32, 48 - rank * 32)
        total = sum(end - start for start, end, _ in written)
        assert total == sum(math.prod(s) * 2 for s in shapes.values()) - padding_rows * H * 2


def test_profile_replays_a_syncs_copies_and_splits_them_by_source_layout():
    """`colocate bench sync`'s breakdown (sync/shards.py profile_copies): one trainer rank holding every row
    replays its copies of a TP=2 sliced plan. The copies from column slices are exactly the row-parallel weights'
    (o_proj, down_proj cut on dim 1), every byte of both workers' slices is counted once, and the replay writes
    what a sync writes."""
    from colocate.sync.shards import bucket_copies, local_shards, profile_copies, run_copies

    hf = hf_state(48, False)
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in hf.items()]
    layouts = [{"tp_rank": r, "tp_size": 2, "params": [(n, s, "torch.bfloat16") for n, s in
                                                         engine_shapes(hf, TPLayout(r, 2, NQ, NKV, HD, 48), False)]}
               for r in range(2)]
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, 48), bucket_bytes=0,
                           num_slots=len(hf))  # a slot per bucket: the replay of every bucket overwrites nothing
    rings = [torch.zeros(plan.ring_bytes, dtype=torch.uint8) for _ in range(2)]
    copies = [c for i in range(len(plan.buckets)) for c in bucket_copies(plan, i, local_shards(hf), rings)]
    run_copies(copies, checksum=False)
    synced = [ring.clone() for ring in rings]
    for ring in rings:
        ring.zero_()
    profile = profile_copies(copies, repeats=2)
    assert all(torch.equal(ring, s) for ring, s in zip(rings, synced))
    row_parallel = {hf[n].data_ptr() for n in hf if n.endswith(("o_proj.weight", "down_proj.weight"))}
    assert {c.source.untyped_storage().data_ptr() for c in copies
                        if not c.source.is_contiguous()} == row_parallel
    assert profile["num_copies"] == len(copies) and profile["num_strided_copies"] == 2 * len(row_parallel)
    assert profile["contiguous_bytes"] + profile["strided_bytes"] == sum(c.num_bytes for c in copies)
    assert profile["strided_bytes"] == sum(hf[n].numel() * 2 for n in hf if n.endswith(("o_proj.weight",
                                                                                           "down_proj.weight")))
    assert min(profile["contiguous_s"], profile["strided_s"], profile["checksum_s"]) > 0
