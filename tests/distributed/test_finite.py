"""NaN/Inf guards of the trainer step on gloo, 2 ranks: a non-finite gradient on one rank stops the step on both,
naming the parameter, with the optimizer not stepped; a non-finite weight after the step (here Adam's second
moment made negative) stops it on both too. No rank is left alone in a collective (the test would hang)."""

from __future__ import annotations

import math

import pytest
import torch

from colocate.config import ModelConfig, TrainerConfig
from colocate.models.sources import ensure_model
from tests.distributed.conftest import run_distributed
from tests.distributed.test_trainer import SEQS

TARGET = "model.layers.0.self_attn.q_proj.weight"


def _trainer(rank: int, world_size: int, port: int, model_path: str, grad_clip: float):
    from colocate.trainer.actor import TrainerActor

    trainer = TrainerActor(rank, world_size, TrainerConfig(lr=1e-2, micro_batch_size=2, grad_clip=grad_clip),
                           model_path, device="cpu", pad_id=0)
    trainer.setup("127.0.0.1", port)
    return trainer


def _step(trainer, world_size: int, rank: int, step: int = 0):
    num_tokens = sum(len(s.response_ids) for s in SEQS)
    return trainer.train_step(SEQS[rank::world_size], step=step, num_tokens_all_ranks=num_tokens,
                              num_micro_batches=2, num_seqs_all_ranks=len(SEQS))


def _bad_gradient(rank: int, world_size: int, port: int, model_path: str, grad_clip: float, value: float,
                  kind: str):
    from colocate.errors import NonFiniteError

    trainer = _trainer(rank, world_size, port, model_path, grad_clip)
    if rank == 1:  # after FSDP's reduce-scatter: only rank 1's shard of one gradient goes bad
        def poison(param):
            with torch.no_grad():
                param.grad.to_local()[0, 0] = value

        trainer.params[TARGET].register_post_accumulate_grad_hook(poison)
    before = {n: p.to_local().clone() for n, p in trainer.params.items()}
    with pytest.raises(NonFiniteError) as info:
        _step(trainer, world_size, rank)
    message = str(info.value)
    assert message.startswith(f"training step 0: gradient of {TARGET} is {kind} on rank 1;"), message
    assert "optimizer step was skipped" in message and "\n" not in message
    assert not trainer.optimizer.state  # not even created
    assert all(torch.equal(p.to_local(), before[n]) for n, p in trainer.params.items())
    trainer.shutdown()


@pytest.mark.parametrize("grad_clip, value, kind", [
    pytest.param(1.0, math.nan, "NaN", id="clipped_nan"),  # found through the clip's total norm
    pytest.param(0.0, math.inf, "Inf", id="unclipped_inf"),  # found by the per-parameter check alone
])
def test_a_non_finite_gradient_on_one_rank_stops_the_step_on_every_rank(tmp_path, grad_clip, value, kind):
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    run_distributed(_bad_gradient, path, grad_clip, value, kind, world_size=2, init=False)


def _bad_update(rank: int, world_size: int, port: int, model_path: str):
    from colocate.errors import NonFiniteError

    trainer = _trainer(rank, world_size, port, model_path, 1.0)
    stats = _step(trainer, world_size, rank)  # a good step: Adam's state exists now
    assert math.isfinite(stats.grad_norm)
    if rank == 1:  # a negative second moment: sqrt gives NaN, the update of this parameter only
        param = trainer.params[TARGET]
        trainer.optimizer.state[param]["exp_avg_sq"].to_local()[0, 0] = -1e30
    with pytest.raises(NonFiniteError) as info:
        _step(trainer, world_size, rank, step=1)
    message = str(info.value)
    assert message.startswith(f"training step 1: {TARGET} is NaN on rank 1 after the optimizer step"), message
    trainer.shutdown()


def test_a_non_finite_weight_after_the_optimizer_step_stops_every_rank(tmp_path):
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    run_distributed(_bad_update, path, world_size=2, init=False)
