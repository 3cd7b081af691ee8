"""The gather protocol's CUDA pieces on one GPU: FSDP2 shards on the GPU, the all-gather over NCCL (world size 1),
the cast into a device ring, checksums read back in one transfer, and the worker's load that synchronises before
the slot goes back. Bit-exact against the layout oracle, over two syncs with the weights changed between."""

from __future__ import annotations

import torch

from tests.distributed.conftest import run_distributed
from tests.distributed.test_shards import _sharded
from tests.unit.test_reshard import HD, NKV, NQ, engine_shapes, hf_state

VOCAB = 49


def _gather_on_gpu(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    from colocate.sync.gather import GatherWriter, plan_gather
    from colocate.sync.load import load_regions
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.shards import local_shards
    from colocate.sync.tp_layout import TPLayout, engine_tensor
    from colocate.sync.buffers import CudaIpcBuffer

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    full = hf_state(VOCAB, tied=False, num_layers=2)
    params, specs = _sharded(full, world_size, device="cuda")
    layout = TPLayout(0, 1, NQ, NKV, HD, VOCAB)
    layouts = [{"tp_rank": 0, "tp_size": 1, "params": [(n, s, "bf16") for n, s in engine_shapes(full, layout, False)]}]
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB), bucket_bytes=4096,
                           num_slots=2)
    ring = CudaIpcBuffer.create(plan.ring_bytes, device=device).tensor
    writer = GatherWriter(plan, plan_gather(plan, specs, world_size=world_size), rank=rank, world_size=world_size,
                          device=device, targets=[(0, ring)])
    engine = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s, _ in layouts[0]["params"]}
    for sync in range(2):
        with torch.no_grad():
            for p in params.values():
                p.to_local().mul_(1.5)
        for index, bucket in enumerate(plan.buckets):
            written = writer.write(index, local_shards(params))  # one checksummed range per tensor
            assert written and all(w == 0 and n > 0 for w, _, n, _ in written)
            load_regions(ring, bucket.regions[0], engine)
        hf = {n: p.full_tensor().to(torch.bfloat16).cpu() for n, p in params.items()}
        for name, value in engine.items():
            expected = engine_tensor(name, hf, layout)
            assert torch.equal(value[:expected.shape[0]].cpu(), expected), (sync, name)
    dist.destroy_process_group()


def test_gather_sync_on_one_gpu_is_bit_exact():
    run_distributed(_gather_on_gpu, world_size=1, init=False)
