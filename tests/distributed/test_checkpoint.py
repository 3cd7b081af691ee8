"""Trainer checkpoints on gloo, 2 ranks: DCP writes each rank's shards; loading them gives back the same weights,
AdamW moments and RNG, in place (the same storages the sync and the offloader hold), and a step after the load
equals the step taken after the save. A fresh trainer resuming is tests/e2e/test_resume.py's."""

from __future__ import annotations

import torch

from colocate.config import ModelConfig, TrainerConfig
from colocate.models.sources import ensure_model
from tests.distributed.conftest import run_distributed
from tests.distributed.test_trainer import SEQS


def _step(trainer, rank: int, world_size: int) -> None:
    num_tokens = sum(len(s.response_ids) for s in SEQS)
    trainer.train_step(SEQS[rank::world_size], step=0, num_tokens_all_ranks=num_tokens, num_micro_batches=2,
                       num_seqs_all_ranks=len(SEQS))


def _snapshot(trainer) -> dict:
    state = {f"w.{k}": v.clone() for k, v in trainer.full_state_dict("float32").items()}
    for name, p in trainer.model.named_parameters():
        for key, value in trainer.optimizer.state.get(p, {}).items():  # a defaultdict: [p] would add frozen ones
            state[f"adam.{name}.{key}"] = value.full_tensor().clone() if hasattr(value, "full_tensor") \
                else value.clone()
    return state


def _save_then_resume(rank: int, world_size: int, port: int, model_path: str, tmp: str, offload: bool,
                      lora_rank: int = 0):
    from colocate.config.schema import LoraConfig
    from colocate.trainer.actor import TrainerActor

    cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, offload="true" if offload else "false",
                        lora=LoraConfig(rank=lora_rank))
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0)
    trainer.setup("127.0.0.1", port)
    _step(trainer, rank, world_size)
    if offload:
        trainer.offload()  # the controller checkpoints whatever the trainer's place is
    trainer.save_checkpoint(f"{tmp}/ckpt")
    rng_at_save = torch.get_rng_state()
    assert trainer._offloaded == offload  # put back where it was
    trainer.onload()
    after_one = _snapshot(trainer)
    if lora_rank:  # the optimizer holds the adapters' state alone
        adam = [k for k in after_one if k.startswith("adam.")]
        assert adam and all(".lora_" in k for k in adam), adam
    _step(trainer, rank, world_size)
    after_two = _snapshot(trainer)
    torch.manual_seed(1234 + rank)  # a different RNG after the save: the load must put the saved one back

    # Loading rewinds the live trainer to the checkpoint (one process group per test process: a second trainer
    # would need a second rendezvous on a port just released). Then the step it takes again is the same step.
    if offload:
        trainer.offload()
    trainer.load_checkpoint(f"{tmp}/ckpt")
    assert trainer._offloaded == offload
    trainer.onload()
    resumed = _snapshot(trainer)
    assert resumed.keys() == after_one.keys()
    for key, value in after_one.items():
        assert torch.equal(resumed[key], value), key
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    # the sync's views (built at setup) still point at the live storages, which hold the loaded values (a LoRA
    # job's B as the engine takes it, scaled: refreshed by the load, so the snapshot's B equals the saved one)
    assert all(view.data_ptr() == p.to_local().data_ptr() for (view, _), p in
               zip(trainer.shards.values(), trainer.sync_tensors.values()) if view.numel())
    _step(trainer, rank, world_size)
    for key, value in _snapshot(trainer).items():
        assert torch.equal(value, after_two[key]), key
    trainer.shutdown()


def _run(tmp_path, offload: bool, lora_rank: int = 0):
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    run_distributed(_save_then_resume, path, str(tmp_path), offload, lora_rank, world_size=2, init=False)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "trainer").iterdir())
    assert ".metadata" in files and "__0_0.distcp" in files and "__1_0.distcp" in files, files
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("rng_rank*.json")) == ["rng_rank0.json",
                                                                                  "rng_rank1.json"]


def test_checkpoint_round_trip_equals_uninterrupted_training(tmp_path):
    _run(tmp_path, offload=False)


def test_checkpoint_of_an_offloaded_trainer(tmp_path):
    _run(tmp_path, offload=True)


def test_a_lora_checkpoint_round_trip_covers_the_adapter_and_its_optimizer(tmp_path):
    """The adapter, AdamW's moments of the adapter alone, and the scaled B the engine receives come back exactly."""
    _run(tmp_path, offload=False, lora_rank=8)
