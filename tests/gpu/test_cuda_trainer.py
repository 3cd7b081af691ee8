"""The trainer's CUDA path: FSDP2 over NCCL (world size 1 on one GPU), a GRPO step, offload to pinned host
buffers and back, and the sliced write of its shards into a ring on the GPU."""

from __future__ import annotations

import pytest
import torch

from colocate.config import ModelConfig, TrainerConfig
from colocate.rl.samples import Sequence
from tests.distributed.conftest import run_distributed

pytest.importorskip("transformers")

SEQS = [Sequence([5, 6, 16], [5, 6, 2], [-3.0, -3.5, -4.0], 1.0),
        Sequence([7, 8, 16], [9], [-3.2], -1.0)]


def _train_on_gpu(rank: int, world_size: int, port: int, model_path: str):
    from colocate.sync.buckets import TensorSpec, group_by_layer, plan_buckets
    from colocate.sync.reshard import SyncPlan
    from colocate.sync.shards import write_bucket
    from colocate.sync.transport import CudaIpcBuffer
    from colocate.trainer.actor import TrainerActor

    trainer = TrainerActor(rank, world_size, TrainerConfig(micro_batch_size=2, mixed_precision=True), model_path,
                           device="cuda", pad_id=0)
    trainer.setup("127.0.0.1", port)  # NCCL
    stats = trainer.train_step(SEQS, step=0, num_tokens_all_ranks=4, num_micro_batches=1,
                               num_seqs_all_ranks=len(SEQS))
    assert stats.tokens == 4 and torch.isfinite(torch.tensor(stats.loss_sum))
    trainer.release_grads()
    before = trainer.full_state_dict("bfloat16")
    allocated = torch.cuda.memory_allocated()
    moved = trainer.offload()
    assert allocated - torch.cuda.memory_allocated() >= 0.9 * moved
    trainer.onload()
    after = trainer.full_state_dict("bfloat16")
    assert all(torch.equal(before[k], after[k]) for k in before)

    specs = [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in trainer.params.items()]
    slot = max(s.num_bytes for s in specs) * 8
    buckets = plan_buckets(group_by_layer(specs), slot_bytes=slot, num_slots=2)
    plan = SyncPlan("full", slot, 2, tuple(buckets))
    ring = CudaIpcBuffer.create(plan.ring_bytes, device=torch.device("cuda", 0)).tensor
    for index, bucket in enumerate(buckets):
        write_bucket(plan, index, trainer.shards, [ring])
        for packed in bucket.tensors:
            got = ring[packed.offset:packed.offset + packed.spec.num_bytes].view(torch.bfloat16)
            assert torch.equal(got.view(packed.spec.shape).cpu(), after[packed.spec.name])
    trainer.shutdown()


def test_fsdp2_nccl_train_offload_and_ring_write(tmp_path):
    from colocate.models.sources import ensure_model

    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path)))
    run_distributed(_train_on_gpu, path, world_size=1, init=False)
