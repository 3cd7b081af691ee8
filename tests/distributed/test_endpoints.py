"""Both ends of every weight-sync protocol as the actors hold them (sync/trainer_end.py `TrainerEnd`,
sync/engine_end.py `WorkerEnd`), on gloo: two trainer ranks, each process also holding an engine worker (as a
co-located slot does), the handles and checksums exchanged as Ray would carry them. After two syncs, each with new
weights, every worker holds exactly its TP slice of the trainer's weights: ring, in place and gather into one
engine of TP=2; broadcast into one engine of TP=1 whose worker lives beside the rank that does not feed it."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import run_distributed
from tests.distributed.test_gather import HD, NKV, NQ, VOCAB, _expected, _plan
from tests.unit.test_reshard import hf_state

CPU = torch.device("cpu")


def _gathered(value):
    """Every rank's `value` (what the controller collects through Ray), in rank order."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _open(method: str, rank: int, trainer, worker, plan, specs, layouts):
    """Open sync "k" as WeightSync.open does for `method`; returns the engine tensors of this process's worker
    (None: none is fed here) and the plan (in place: rebuilt on the workers' arena offsets)."""
    import torch.distributed as dist

    from colocate.sync.gather import plan_gather
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.tp_layout import TPLayout

    tp = len(layouts)
    mine = rank < tp  # TP=2: rank r's worker is TP rank r; TP=1 (broadcast): the worker is beside rank 1
    if method == "broadcast":
        mine = rank == 1
    params = {n: torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16), requires_grad=False)
              for n, s, _ in layouts[0 if method == "broadcast" else rank]["params"]} if mine else None
    groups = plan_gather(plan, specs, world_size=2)
    if method == "in_place":
        worker.share_weights(params)  # the Parameters stay, their storage moves into the arena
        plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB), bucket_bytes=0,
                               num_slots=2, param_offsets=_gathered(worker.arena.offsets))
    if method == "broadcast":
        addresses = {t: a for stores in _gathered(trainer.open_broadcast_stores("k", tp=1, num_members=2,
                                                                                 loopback=True, timeout_s=60))
                     for t, a in stores.items()}
        # the feeder (rank 0) joins in attach_broadcast, the worker in open_ring: each blocks until both are in
        trainer.attach_broadcast("k", plan, groups, num_members=2, timeout_s=60, checksum=True)
        if mine:
            worker.open_ring("k", plan, tp_rank=0, params=params, engine_index=0,
                             broadcast={"addresses": addresses, "num_members": 2, "timeout_s": 60})
        return params, plan
    handles = _gathered(worker.open_ring("k", plan, tp_rank=rank, params=params, engine_index=0))
    if method == "gather":
        trainer.attach_gather("k", plan, groups, (0, rank), handles[rank], checksum=True)
    else:
        trainer.attach_ring("k", 0, handles, plan, checksum=method == "ring")
    dist.barrier()  # every party mapped the rings
    worker.seal("k")
    return params, plan


def _write(method: str, trainer, index: int, shards):
    if method == "ring":
        return trainer.write_bucket("k", 0, index, shards)
    if method == "gather":
        return trainer.gather_write("k", index, [], shards)
    return trainer.broadcast_write("k", index, shards)


def _sync_rank(rank: int, world_size: int, method: str):
    import torch.distributed as dist

    from colocate.sync.engine_end import WorkerEnd
    from colocate.sync.shards import local_shards
    from colocate.sync.trainer_end import TrainerEnd
    from tests.distributed.test_shards import _sharded

    full = hf_state(VOCAB, tied=False, num_layers=2)
    sharded, specs = _sharded(full, world_size)
    plan, specs, layouts = _plan(full, 1 if method == "broadcast" else 2, False, 0, True)
    trainer, worker = TrainerEnd(rank=rank, world_size=world_size, device=CPU), WorkerEnd(device=CPU)
    params, plan = _open(method, rank, trainer, worker, plan, specs, layouts)
    for sync in range(2):
        with torch.no_grad():  # training changed the weights: the next sync must carry the new values
            for p in sharded.values():
                p.to_local().add_(0.25 * (sync + 1))
        shards = local_shards(sharded)
        if method == "in_place":
            written = trainer.write_in_place("k", 0, shards)
            dist.barrier()  # the engine checks once every rank wrote
            _, error = worker.verify_in_place("k", [])
            assert error is None, error
            assert written == []  # no checksums in place: writer and engine share the pages
        else:
            for index in range(len(plan.buckets)):
                written = _write(method, trainer, index, shards)
                if method == "broadcast" and params is not None:
                    _, _, error = worker.receive("k", index)  # after this rank's part of the gather
                    assert error is None, error
                checksums = [c for rank_sums in _gathered(written) for c in rank_sums]
                if params is not None:
                    _, _, error = worker.load("k", index, checksums, None)
                    assert error is None, error
                dist.barrier()  # the slot is free again
        current = {n: p.full_tensor() for n, p in sharded.items()}
        if params is not None:
            layout = layouts[0 if method == "broadcast" else rank]
            for name, expected in _expected(current, layout, False).items():
                assert torch.equal(params[name][:expected.shape[0]], expected), (method, sync, rank, name)
        # every rank checked before the next sync writes: in place, a rank's writes land in every worker's pages
        dist.barrier()
    assert trainer.take_write_times() and not trainer.take_write_times()  # each write timed, taken once
    if method == "in_place":
        worker.arena.unlink()


@pytest.mark.parametrize("method", ["ring", "in_place", "gather", "broadcast"])
def test_both_ends_of_every_protocol_leave_each_worker_its_slice(method):
    run_distributed(_sync_rank, method)
