"""The reference policy and the KL penalty on gloo, 2 ranks: the KL starts at exactly 0 (the reference is the
initial policy), grows once the policy moves, the reference never trains, and it stays offloaded between uses."""

from __future__ import annotations

import pytest
import torch

from colocate.config import AlgoConfig, ModelConfig, TrainerConfig
from colocate.models.sources import ensure_model
from tests.distributed.conftest import run_distributed
from colocate.trainer.lora import lora_modules
from tests.distributed.test_trainer import SEQS


def _storages_freed(reference) -> bool:
    return all(p.to_local().untyped_storage().nbytes() == 0 for p in reference.model.parameters())


def _all_ranks_kl(stats: dict) -> float:
    """The controller's "kl": the ranks' kl_sum over their tokens."""
    import torch.distributed as dist

    sums = torch.tensor([stats.kl_sum, stats.tokens], dtype=torch.float64)
    dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def _kl_steps(rank: int, world_size: int, port: int, model_path: str):
    from torch.distributed.tensor import DTensor

    from colocate.trainer.actor import TrainerActor

    cfg = TrainerConfig(lr=5e-2, micro_batch_size=2, grad_clip=0.0)  # a large step: the policy must move
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0,
                           algo=AlgoConfig(kl_coef=0.1, kl_estimator="k3"))
    info = trainer.setup("127.0.0.1", port)
    reference = trainer.reference
    assert reference is not None and reference.offloaded and _storages_freed(reference)
    assert info["reference_local_bytes"] == info["local_param_bytes"]  # one more sharded copy, same dtype (fp32)
    assert all(not p.requires_grad for p in reference.model.parameters())

    initial = trainer.full_state_dict("float32")
    ref_before = reference.full_state_dict()
    assert reference.offloaded and _storages_freed(reference)  # the verification put it back out
    assert ref_before.keys() == initial.keys() and all(torch.equal(ref_before[k], initial[k]) for k in initial)

    num_tokens = sum(len(s.response_ids) for s in SEQS)
    # rank 0 has 3 sequences, rank 1 has 2: rank 1 runs a dummy micro-batch, reference forward included
    step = dict(step=0, num_tokens_all_ranks=num_tokens, num_micro_batches=2, num_seqs_all_ranks=len(SEQS))
    first = trainer.train_step(SEQS[rank::world_size], **step)
    assert first.kl_sum == 0.0 and _all_ranks_kl(first) == 0.0  # the policy is still the reference
    trainer.release_grads()

    # between steps: offloaded, every local storage empty, and no gathered (unsharded) parameter kept either
    assert reference.offloaded and _storages_freed(reference)
    assert all(isinstance(p, DTensor) for p in reference.model.parameters())
    moved = reference.onload()
    assert moved >= reference.local_bytes > 0  # what the offloader held was the whole local state
    assert reference.offload() == moved and _storages_freed(reference)

    second = trainer.train_step(SEQS[rank::world_size], **step)
    assert second.kl_sum > 0 and _all_ranks_kl(second) > 1e-6, second.kl_sum
    assert reference.offloaded and _storages_freed(reference)

    ref_after = reference.full_state_dict()
    assert all(torch.equal(ref_after[k], ref_before[k]) for k in ref_before), "the reference trained"
    trained = trainer.full_state_dict("float32")
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), "the policy did not move"
    trainer.shutdown()


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])  # tied: lm_head is the embedding, in both copies
def test_kl_is_zero_at_the_start_grows_with_training_and_the_reference_stays_frozen_and_offloaded(tmp_path, preset):
    path = ensure_model(ModelConfig(preset=preset, cache_dir=str(tmp_path / "models")))
    run_distributed(_kl_steps, path, world_size=2, init=False)


def _lora_kl_steps(rank: int, world_size: int, port: int, model_path: str):
    from colocate.config.schema import LoraConfig
    from colocate.trainer.actor import TrainerActor
    from colocate.trainer.reference import BaseReference

    cfg = TrainerConfig(lr=5e-2, micro_batch_size=2, grad_clip=0.0, lora=LoraConfig(rank=8))
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0,
                           algo=AlgoConfig(kl_coef=0.1, kl_estimator="k3"))
    info = trainer.setup("127.0.0.1", port)
    assert isinstance(trainer.reference, BaseReference) and info["reference_local_bytes"] == 0  # no copy
    initial = trainer.full_state_dict("float32")
    num_tokens = sum(len(s.response_ids) for s in SEQS)
    step = dict(step=0, num_tokens_all_ranks=num_tokens, num_micro_batches=2, num_seqs_all_ranks=len(SEQS))
    first = trainer.train_step(SEQS[rank::world_size], **step)
    assert first.kl_sum == 0.0 and _all_ranks_kl(first) == 0.0  # B = 0: the policy is its base
    trainer.release_grads()
    second = trainer.train_step(SEQS[rank::world_size], **step)
    assert second.kl_sum > 0 and _all_ranks_kl(second) > 1e-6, second.kl_sum
    # the reference is the base, which never moved; only adapters did, and the adapters are on again
    trained = trainer.full_state_dict("float32")
    assert all(torch.equal(trained[k], initial[k]) for k in initial if ".lora_" not in k)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial if ".lora_B." in k)
    assert all(m.enabled for m in lora_modules(trainer.model).values())
    trainer.shutdown()


def test_a_lora_jobs_reference_is_its_base_with_the_adapters_off(tmp_path):
    path = ensure_model(ModelConfig(cache_dir=str(tmp_path / "models")))
    run_distributed(_lora_kl_steps, path, world_size=2, init=False)
