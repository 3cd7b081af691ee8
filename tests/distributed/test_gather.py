"""The gather protocol (the CUDA path's sync, run here on gloo and shared memory): every rank all-gathers each
layer group and writes only the TP slice of the engine worker on its own device into that worker's ring; the
worker loads each bucket with the production loader. After every sync each worker holds exactly its TP slice
of the trainer's weights, bit for bit: engine TP=2 (rank r feeds worker r), TP=1 x 2 engines (rank r feeds
engine r's only worker), a tied vocabulary, uneven FSDP2 shards,
small slots that split tensors across buckets, and the full-tensor plan (vLLM's load_weights path)."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.buffers import ShmBuffer, ShmHandle
from tests.distributed.conftest import run_distributed
from tests.distributed.test_shards import _sharded
from tests.unit.test_reshard import HD, NKV, NQ, engine_shapes, hf_state

VOCAB = 49  # rows split 25/24 by FSDP2, padded to 64 for TP=2: TP rank 0's rows span both shards


def _plan(full, tp: int, tied: bool, bucket_bytes: int, sliced: bool):
    from colocate.sync.buckets import TensorSpec
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.tp_layout import TPLayout

    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in full.items()]
    layouts = [{"tp_rank": r, "tp_size": tp,
                "params": [(n, s, "bf16") for n, s in engine_shapes(full, TPLayout(r, tp, NQ, NKV, HD, VOCAB), tied)]}
               for r in range(tp)]
    return build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB),
                           bucket_bytes=bucket_bytes, num_slots=2, sliced=sliced), specs, layouts


def _expected(full, layout_dict, tied: bool) -> dict[str, torch.Tensor]:
    from colocate.sync.tp_layout import TPLayout, engine_tensor

    layout = TPLayout(layout_dict["tp_rank"], layout_dict["tp_size"], NQ, NKV, HD, VOCAB)
    hf = {n: t.to(torch.bfloat16) for n, t in full.items()}
    return {n: engine_tensor(n, hf, layout) for n, _, _ in layout_dict["params"]}


def _sync_rank(rank: int, world_size: int, handles: list[ShmHandle], tp: int, tied: bool, bucket_bytes: int,
               sliced: bool, num_syncs: int):
    """Trainer rank `rank` and, beside it, the engine worker it feeds (as on one GPU: same process here)."""
    import torch.distributed as dist

    from colocate.sync.gather import GatherWriter, plan_gather
    from colocate.sync.load import verify_then_load
    from colocate.sync.shards import local_shards
    from colocate.sync.buffers import attach
    from colocate.sync.verify import tensor_spans

    full = hf_state(VOCAB, tied=tied, num_layers=2)
    params, specs = _sharded(full, world_size)
    plan, specs, layouts = _plan(full, tp, tied, bucket_bytes, sliced)
    assert (plan.mode == "sliced") == sliced
    # engine TP=2: one engine, rank r feeds tp worker r; TP=1: two engines, rank r feeds engine r's worker 0
    worker = rank if tp == 2 else 0
    ring = attach(handles[rank])
    writer = GatherWriter(plan, plan_gather(plan, specs, world_size=world_size), rank=rank, world_size=world_size,
                          device=torch.device("cpu"), targets=[(worker, ring)])
    engine = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s, _ in layouts[worker]["params"]}
    for sync in range(num_syncs):
        with torch.no_grad():  # training changed the weights: the next sync must carry the new values
            for p in params.values():
                p.to_local().add_(0.25 * (sync + 1))
        for v in engine.values():
            v.zero_()
        shards = local_shards(params)
        received = {}  # full mode: the full tensors as each bucket delivered them
        for index in range(len(plan.buckets)):
            written = writer.write(index, shards)
            spans = tensor_spans(plan, index, worker)  # one checksummed range per tensor of the bucket
            assert [(w, s, n) for w, s, n, _ in written] == [(worker, s.start, s.num_bytes) for s in spans]
            # the worker's own load: verify the checksums, then copy (full mode: into load_weights)
            _, _, error = verify_then_load(plan, index, ring, written, worker=worker, params=engine,
                                           load_weights=lambda weights, into=received: into.update(
                                               (name, view.clone()) for name, view in weights))
            assert error is None, error
        if not sliced:  # sliced here by the layout oracle, as vLLM's load_weights slices full tensors
            from colocate.sync.tp_layout import TPLayout, engine_tensor

            for name in engine:
                value = engine_tensor(name, received, TPLayout(worker, tp, NQ, NKV, HD, VOCAB))
                engine[name][:value.shape[0]] = value
        current = {n: p.full_tensor() for n, p in params.items()}
        for name, expected in _expected(current, layouts[worker], tied).items():
            assert torch.equal(engine[name][:expected.shape[0]], expected), (sync, rank, name)
        dist.barrier()
    assert writer.gatherer.received.untyped_storage().nbytes() == 0  # released between syncs


@pytest.mark.parametrize("tp, tied, bucket_bytes, sliced", [
    pytest.param(2, False, 0, True, id="tp2_one_engine"),
    pytest.param(1, False, 0, True, id="tp1_two_engines"),
    pytest.param(2, True, 2048, True, id="tp2_tied_small_slots"),
    pytest.param(2, False, 0, False, id="tp2_full_tensors"),
])
def test_gather_then_local_write_is_bit_exact_after_every_sync(tp, tied, bucket_bytes, sliced):
    full = hf_state(VOCAB, tied=tied, num_layers=2)
    plan, _, _ = _plan(full, tp, tied, bucket_bytes, sliced)
    owners = [ShmBuffer.create(plan.ring_bytes, tag="test") for _ in range(2)]  # one ring per worker
    try:
        run_distributed(_sync_rank, [o.handle for o in owners], tp, tied, bucket_bytes, sliced, 2)
    finally:
        for owner in owners:
            owner.unlink()


def test_gather_groups_read_the_embeddings_for_a_tied_lm_head():
    """An engine that keeps an lm_head of its own for a tied model (the trainer has only the embeddings): the
    post group's buckets read a tensor of the pre group, so the post group gathers it too."""
    from colocate.sync.buckets import TensorSpec
    from colocate.sync.gather import plan_gather
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.tp_layout import TPLayout

    full = hf_state(VOCAB, tied=True, num_layers=1)
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in full.items()]
    layouts = [{"tp_rank": r, "tp_size": 2, "params": [(n, s, "bf16") for n, s in engine_shapes(
        full, TPLayout(r, 2, NQ, NKV, HD, VOCAB), tied=False)]} for r in range(2)]
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB), bucket_bytes=0,
                           num_slots=2)
    groups = plan_gather(plan, specs, world_size=2)
    assert [t.name for t in groups["post"].tensors] == ["model.norm.weight", "model.embed_tokens.weight"]
    embed = next(t for t in groups["pre"].tensors if t.name == "model.embed_tokens.weight")
    assert embed.rank_rows(0) == (0, 25) and embed.rank_rows(1) == (25, 24)  # FSDP2's torch.chunk rows
