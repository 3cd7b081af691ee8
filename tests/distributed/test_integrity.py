"""A corrupted ring slot fails the sync with the tensor's name before the engine loads from it. Two FSDP2 ranks
write every bucket with the production writers (per-rank copies through the ring, the gather protocol, the
full-tensor plan); between their write and the engine worker's load, one byte of one tensor in the slot is
flipped; the worker's real load path (`verify_then_load`, what `colocate_load` runs) must refuse that bucket,
name the tensor, its rows and the trainer's tensor, and leave every parameter of the bucket as it was."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.buffers import ShmBuffer, ShmHandle
from tests.distributed.conftest import run_distributed
from tests.distributed.test_gather import VOCAB, _plan
from tests.distributed.test_shards import _sharded
from tests.unit.test_reshard import hf_state

OLD = 7.0  # every engine parameter before the sync


def _target(plan, worker: int) -> tuple[int, int, str]:
    """(bucket, ring offset of one byte, what the error must name): a byte of layer 1's K rows."""
    index = next(b.index for b in plan.buckets if b.group == "layer.1")
    if plan.mode == "full":
        (packed,) = [t for t in plan.buckets[index].tensors if t.spec.name == "model.layers.1.self_attn.k_proj.weight"]
        return index, packed.offset + 3, "model.layers.1.self_attn.k_proj.weight rows [0, "
    (region,) = [r for r in plan.buckets[index].regions[worker]
                 if r.engine_name.endswith("1.self_attn.qkv_proj.weight")]
    k_row = next(p.dst_row for p in plan.pieces[worker][region.engine_name] if "k_proj" in p.hf_name)
    return index, region.offset + (k_row - region.row_start) * region.row_bytes + 3, \
        "model.layers.1.self_attn.qkv_proj.weight rows ["


def _corrupt_one_slot(rank: int, world_size: int, handle: ShmHandle, method: str, sliced: bool):
    import torch.distributed as dist

    from colocate.sync.gather import GatherWriter, plan_gather
    from colocate.sync.load import verify_then_load
    from colocate.sync.shards import local_shards, write_bucket
    from colocate.sync.buffers import attach

    full = hf_state(VOCAB, tied=False, num_layers=2)
    params, specs = _sharded(full, world_size)
    plan, specs, layouts = _plan(full, 2, False, 0, sliced)
    whole = attach(handle)
    # ring: one ring per worker, except the full plan's, which the workers share (as on the CPU runtime)
    rings = [whole[:plan.ring_bytes], whole[plan.ring_bytes:]] if sliced else [whole[:plan.ring_bytes]] * 2
    worker = 1  # the engine worker checked here, in rank 1's process (beside it, as on one GPU)
    writer = GatherWriter(plan, plan_gather(plan, specs, world_size=world_size), rank=rank, world_size=world_size,
                          device=torch.device("cpu"), targets=[(rank, rings[rank])]) if method == "gather" else None
    engine = {n: torch.full(s, OLD, dtype=torch.bfloat16) for n, s, _ in layouts[worker]["params"]}
    loaded = {}  # full plan: what load_weights received
    bad_index, bad_byte, named = _target(plan, worker)
    shards = local_shards(params)
    for index in range(len(plan.buckets)):
        written = writer.write(index, shards) if writer else write_bucket(plan, index, shards, rings)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, written)  # what Ray hands the engine's load_bucket
        if index == bad_index and rank == 0:  # after every rank wrote and checksummed the slot
            rings[worker][bad_byte] ^= 0x10
        dist.barrier()
        if rank == 1:
            before = {n: t.clone() for n, t in engine.items()}
            _, _, error = verify_then_load(plan, index, rings[worker], [c for r in per_rank for c in r],
                                           worker=worker, params=engine, engine=0, shared=not sliced,
                                           load_weights=lambda weights, i=index: loaded.update({i: weights}))
            if index == bad_index:
                _assert_refused(error, plan, index, worker, named, engine, before, loaded)
            else:
                assert error is None, error
        dist.barrier()  # the slot is free again for bucket index + num_slots


def _assert_refused(error, plan, index, worker, named, engine, before, loaded):
    assert error is not None and "\n" not in error
    assert error.startswith(f"weight sync: bucket {index} (layer.1) of engine 0 (TP rank {worker}) arrived "
                            f"corrupted in {named}"), error
    assert "model.layers.1.self_attn.k_proj.weight" in error and "checksum 0x" in error
    assert "the bucket was not loaded" in error
    # nothing of the bucket reached the parameters, and load_weights never saw its bytes
    assert all(torch.equal(engine[n], before[n]) for n in engine) and index not in loaded
    if plan.mode == "sliced":
        assert all(torch.equal(engine[r.engine_name], torch.full_like(engine[r.engine_name], OLD))
                   for r in plan.buckets[index].regions[worker])


@pytest.mark.parametrize("method, sliced", [
    pytest.param("ring", True, id="ring_sliced"),
    pytest.param("gather", True, id="gather_sliced"),
    pytest.param("ring", False, id="ring_full_shared"),  # worker 1 reads the ring worker 0's checksums cover
])
def test_a_flipped_byte_in_a_slot_fails_the_load_naming_the_tensor(method, sliced):
    full = hf_state(VOCAB, tied=False, num_layers=2)
    plan, _, _ = _plan(full, 2, False, 0, sliced)
    owner = ShmBuffer.create(2 * plan.ring_bytes, tag="test")
    try:
        run_distributed(_corrupt_one_slot, owner.handle, method, sliced)
    finally:
        owner.unlink()
