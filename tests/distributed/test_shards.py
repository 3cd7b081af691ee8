"""Each FSDP2 rank writes its own rows straight into the shared bucket; the bucket then holds the full tensors
(cast to the engine dtype), equal to `full_tensor()`, also for dims the world size does not divide."""

from __future__ import annotations

import torch

from colocate.sync.buckets import TensorSpec, group_by_layer, plan_buckets
from colocate.sync.transport import ShmBuffer, ShmHandle, attach
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

    from colocate.sync.shards import write_local_shards

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
        written = write_local_shards(bucket, params, ring)
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
