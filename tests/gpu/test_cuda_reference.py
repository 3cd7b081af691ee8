"""The reference policy on CUDA (NCCL, world size 1, mixed precision): stored in bf16 (half the policy's fp32
shards) yet computing what the policy computes, offloaded by its own offloader without touching the policy's
state (torch_memory_saver pauses by tag: a shared tag would pause the policy's memory under its next forward)."""

from __future__ import annotations

import pytest
import torch

from colocate.config import AlgoConfig, ModelConfig, TrainerConfig
from colocate.rl.samples import Sequence
from tests.distributed.conftest import run_distributed

pytest.importorskip("transformers")

SEQS = [Sequence([5, 6, 16], [5, 6, 2], [-3.0, -3.5, -4.0], 1.0),
        Sequence([7, 8, 16], [9], [-3.2], -1.0)]


def _kl_on_gpu(rank: int, world_size: int, port: int, model_path: str, backend: str):
    from colocate.trainer.actor import TrainerActor

    cfg = TrainerConfig(lr=5e-2, micro_batch_size=2, grad_clip=0.0, mixed_precision=True, offload_backend=backend)
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cuda", pad_id=0,
                           algo=AlgoConfig(kl_coef=0.1))
    info = trainer.setup("127.0.0.1", port)
    reference = trainer.reference
    assert reference.offloaded and reference._offloader.name == backend
    assert all(p.dtype == torch.bfloat16 for p in reference.model.parameters())
    assert 2 * info["reference_local_bytes"] == info["local_param_bytes"]
    initial = trainer.full_state_dict("bfloat16")
    ref_before = reference.full_state_dict()
    assert all(torch.equal(ref_before[k], initial[k]) for k in initial)  # the bf16 cast of the same fp32 values

    step = dict(step=0, num_tokens_all_ranks=4, num_micro_batches=1, num_seqs_all_ranks=len(SEQS))
    first = trainer.train_step(SEQS, **step)  # the reference scored, offloaded, then the policy ran beside it
    # the same bf16 weights and kernels; a tolerance only in case a kernel differs with autograd on
    assert abs(first.kl_sum) <= 1e-5 * first.tokens, first.kl_sum
    trainer.release_grads()

    if backend == "pinned":  # torch_memory_saver unmaps under torch's counters: its own test checks the driver
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        moved = reference.onload()
        assert torch.cuda.memory_allocated() - allocated >= reference.local_bytes and moved >= reference.local_bytes
        reference.offload()
        assert torch.cuda.memory_allocated() == allocated
    policy = trainer.full_state_dict("float32")  # readable: the reference's offload left the policy alone

    second = trainer.train_step(SEQS, **step)
    assert second.kl_sum > 0 and reference.offloaded
    ref_after, trained = reference.full_state_dict(), trainer.full_state_dict("float32")
    assert all(torch.equal(ref_after[k], ref_before[k]) for k in ref_before)
    assert any(not torch.equal(trained[k], policy[k]) for k in policy)
    trainer.shutdown()


@pytest.mark.parametrize("backend", ["pinned", "torch_memory_saver"])
def test_reference_in_bf16_offloaded_on_its_own(tmp_path, backend):
    if backend == "torch_memory_saver":
        pytest.importorskip("torch_memory_saver")
    from colocate.models.sources import ensure_model

    path = ensure_model(ModelConfig(preset="tiny-tied", cache_dir=str(tmp_path)))
    run_distributed(_kl_on_gpu, path, backend, world_size=1, init=False)
