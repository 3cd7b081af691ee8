"""Each FSDP2 rank writes its own rows straight into the shared bucket; the bucket then holds the full tensors
(cast to the engine dtype), equal to `full_tensor()`, also for dims the world size does not divide."""

from __future__ import annotations

import torch

from colocate.sync.buckets import TensorSpec, group_by_layer, plan_buckets
from colocate.sync.buffers import ShmBuffer, ShmHandle, attach
from tests.distributed.conftest import run_distributed


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = torch.nn.Linear(7, 5, bias=True)  # 5 rows over 2 ranks: 3 + 2; bias of 5
        self.tiny = torch.nn.Parameter(torch.randn(1))  # 1 row: rank 1 holds nothing
        self.wide = torch.nn.Linear(16, 32, bias=False)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])


def _write_and_check(rank: int, world_size: int, handle: ShmHandle, slot_bytes: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from colocate.sync.shards import local_shards, write_local_shards

    torch.manual_seed(0)
    model = Model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = {f"model.{n}": p for n, p in model.named_parameters()}
    specs = [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in params.items()]
    buckets = plan_buckets(group_by_layer(specs), slot_bytes=slot_bytes, num_slots=2)
    ring = attach(handle)
    for bucket in buckets:
        written = write_local_shards(bucket, local_shards(params), ring)
        dist.barrier()  # in the runtime, the engine's load waits for every rank's write
        assert all(start + n <= ring.numel() for start, n in written)
        for packed in bucket.tensors:
            n = packed.spec.num_bytes
            got = ring[packed.offset:packed.offset + n].view(torch.bfloat16).view(packed.spec.shape)
            expected = params[packed.spec.name].full_tensor().to(torch.bfloat16)
            assert torch.equal(got, expected), packed.spec.name
        dist.barrier()  # the next bucket may reuse a slot


def test_ranks_write_their_rows_into_the_bucket():
    slot_bytes = 4096
    owner = ShmBuffer.create(2 * slot_bytes, tag="test")
    try:
        run_distributed(_write_and_check, owner.handle, slot_bytes)
    finally:
        owner.unlink()


def _sharded(full: dict[str, torch.Tensor], world_size: int, device: str = "cpu"):
    """HF-named tensors as one FSDP2-sharded module on `device`: (name -> sharded parameter, bf16 specs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(t.clone())
                                             for n, t in full.items()})

    model = Flat()
    fully_shard(model, mesh=init_device_mesh(device, (world_size,)))
    params = {n.replace("__", "."): p for n, p in model.p.items()}
    return params, [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in full.items()]


def _sliced_write(rank: int, world_size: int, handle: ShmHandle, vocab: int, bucket_bytes: int):
    """FSDP2 over 2 ranks (rows split 25/24 for a 49-row vocabulary), engine TP=2 (vocabulary padded to 64, so
    TP rank 0's rows span both FSDP shards); small slots split tensors by rows. After all ranks wrote a bucket,
    each worker's regions hold exactly its slice of the full tensors."""
    import torch.distributed as dist

    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.shards import local_shards, write_bucket
    from colocate.sync.tp_layout import TPLayout, engine_tensor
    from tests.unit.test_reshard import HD, NKV, NQ, engine_shapes, hf_state

    full = hf_state(vocab, tied=False, num_layers=1)
    params, specs = _sharded(full, world_size)
    layouts = [{"tp_rank": r, "tp_size": 2,
                "params": [(n, s, "bf16") for n, s in engine_shapes(full, TPLayout(r, 2, NQ, NKV, HD, vocab), False)]}
               for r in range(2)]
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, vocab), bucket_bytes=bucket_bytes,
                           num_slots=2)
    assert plan.mode == "sliced" and len(plan.buckets) > 4  # split by rows into many buckets
    whole = attach(handle)
    rings = [whole[:plan.ring_bytes], whole[plan.ring_bytes:2 * plan.ring_bytes]]  # one ring per worker
    engines = [{n: torch.zeros(s, dtype=torch.bfloat16) for n, s, _ in layout["params"]} for layout in layouts]
    for index, bucket in enumerate(plan.buckets):
        written = write_bucket(plan, index, local_shards(params), rings)
        assert {w for w, *_ in written} <= {0, 1}
        dist.barrier()
        for worker, regions in enumerate(bucket.regions):  # what colocate_load does, on every rank
            ring = rings[worker]
            for region in regions:
                target = engines[worker][region.engine_name]
                target = target.view(target.shape[0], -1)
                start = region.offset
                source = ring[start:start + region.num_bytes].view(torch.bfloat16)
                source = source.view(region.num_rows, region.num_cols)
                target[region.row_start:region.row_start + region.num_rows] = source
        dist.barrier()
    for r in range(2):
        layout = TPLayout(r, 2, NQ, NKV, HD, vocab)
        for name, tensor in engines[r].items():
            expected = engine_tensor(name, {n: t.to(torch.bfloat16) for n, t in full.items()}, layout)
            assert torch.equal(tensor[: expected.shape[0]], expected), (r, name)


def test_ranks_write_each_workers_tp_slice_across_uneven_shards_and_split_tensors():
    bucket_bytes = 2048
    owner = ShmBuffer.create(2 * 2 * bucket_bytes, tag="test")
    try:
        run_distributed(_sliced_write, owner.handle, 49, bucket_bytes)
    finally:
        owner.unlink()


def _in_place_write(rank: int, world_size: int, handles: list[ShmHandle], offsets: list[dict], layouts: list[dict],
                    vocab: int):
    """The in-place plan: the regions address each worker's parameters in its arena; the ranks write every
    bucket without waiting for anyone, and no copy follows."""
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.shards import local_shards, write_bucket
    from colocate.sync.tp_layout import TPLayout
    from tests.unit.test_reshard import HD, NKV, NQ, hf_state

    full = hf_state(vocab, tied=False, num_layers=2)
    params, specs = _sharded(full, world_size)
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, vocab), bucket_bytes=0,
                           num_slots=2, param_offsets=offsets)
    assert plan.in_place and plan.ring_bytes == 0
    assert [b.group for b in plan.buckets] == ["pre", "layer.0", "layer.1", "post"]  # one bucket per layer
    arenas = [attach(h) for h in handles]
    for index in range(len(plan.buckets)):
        write_bucket(plan, index, local_shards(params), arenas, checksum=False)


def test_ranks_write_in_place_into_the_engine_workers_parameters():
    from colocate.sync.arena import WeightArena
    from colocate.sync.tp_layout import TPLayout, engine_tensor
    from tests.unit.test_reshard import HD, NKV, NQ, engine_shapes, hf_state

    vocab = 49  # rows split 25/24 by FSDP2, padded to 64 for TP=2: TP rank 0's rows span both shards
    full = hf_state(vocab, tied=False, num_layers=2)
    tp = [TPLayout(r, 2, NQ, NKV, HD, vocab) for r in range(2)]
    workers = [{n: torch.nn.Parameter(torch.full(s, 7.0, dtype=torch.bfloat16), requires_grad=False)
                for n, s in engine_shapes(full, layout, False)} for layout in tp]
    arenas = [WeightArena(w, tag="test") for w in workers]
    try:
        layouts = [{"tp_rank": r, "tp_size": 2, "params": [(n, tuple(p.shape), "bf16") for n, p in w.items()]}
                   for r, w in enumerate(workers)]
        run_distributed(_in_place_write, [a.handle for a in arenas], [a.offsets for a in arenas], layouts, vocab)
    finally:
        for arena in arenas:
            arena.unlink()
    for layout, worker, arena in zip(tp, workers, arenas):
        assert arena.detached() == []
        for name, param in worker.items():
            expected = engine_tensor(name, {n: t.to(torch.bfloat16) for n, t in full.items()}, layout)
            assert torch.equal(param[: expected.shape[0]], expected), (layout.tp_rank, name)
