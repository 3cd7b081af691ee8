"""PPO's critic on the FSDP2 trainer (gloo): its values and its update on 2 ranks equal 1 rank's; its gradient
never reaches the policy (a step with the critic trains the policy bit for bit as one without it); it leaves the
device with the policy's state and comes back exact; its checkpoint round-trips."""

from __future__ import annotations

import pytest
import torch

from colocate.config import AlgoConfig, CriticConfig, ModelConfig, RolloutConfig, TrainerConfig
from colocate.models.sources import ensure_model
from colocate.rl.gae import with_gae
from colocate.rl.samples import Sequence
from tests.distributed.conftest import run_distributed

SEQS = [
    Sequence([5, 6, 16], [5, 6, 2], [-3.0, -3.5, -4.0], 1.0),
    Sequence([7, 8, 16], [9], [-3.2], 0.0),
    Sequence([5, 16], [5, 2], [-3.9, -3.1], 1.0),
    Sequence([9, 9, 9, 16], [9, 9, 9, 2], [-3.0] * 4, 0.0, mask=[1, 0, 0, 1]),  # a multi-turn observation
    Sequence([6, 16], [6, 6], [-3.3, -3.3], 0.5),
]
ALGO = AlgoConfig(advantage="gae", gamma=0.9, lam=0.8, clip_eps=50.0)  # wide clip: every token keeps its gradient
CFG = TrainerConfig(lr=1e-2, micro_batch_size=2, grad_clip=0.0, logprob_chunk_tokens=1024)
CRITIC = CriticConfig(model_path="policy", lr=1e-2, grad_clip=0.0, value_clip=0.05)


def _trainer(rank, world_size, port, model_path, critic):
    from colocate.trainer.actor import TrainerActor

    trainer = TrainerActor(rank, world_size, CFG, model_path, device="cpu", pad_id=0, algo=ALGO,
                           sampling=RolloutConfig(), critic=critic)
    trainer.setup("127.0.0.1", port)
    return trainer


def _num_micro_batches(world_size: int) -> int:
    from colocate.trainer.batching import trainer_micro_batches

    return max(len(trainer_micro_batches(SEQS[r::world_size], CFG)) for r in range(world_size))


def _gathered(world_size: int, part: list) -> list:
    """Every rank's list, in SEQS order (rank r holds SEQS[r::world_size])."""
    if world_size == 1:
        return part
    parts = [None] * world_size
    torch.distributed.all_gather_object(parts, part)
    out = [None] * len(SEQS)
    for r, rows in enumerate(parts):
        out[r::world_size] = rows
    return out


def _critic_step(rank: int, world_size: int, port: int, model_path: str, out_path: str):
    trainer = _trainer(rank, world_size, port, model_path, CRITIC)
    n = _num_micro_batches(world_size)
    num_tokens = sum(s.num_trained_tokens for s in SEQS)
    # a first step: the zero-initialised head learns, so the second step's values are not all 0
    step = dict(num_tokens_all_ranks=num_tokens, num_micro_batches=n, num_seqs_all_ranks=len(SEQS))
    zero = _gathered(world_size, trainer.values(SEQS[rank::world_size], num_micro_batches=n))
    assert all(v == 0.0 for row in zero for v in row)
    trainer.train_step(with_gae(SEQS, zero, gamma=0.9, lam=0.8)[rank::world_size], step=0, **step)
    values = _gathered(world_size, trainer.values(SEQS[rank::world_size], num_micro_batches=n))
    stats = trainer.train_step(with_gae(SEQS, values, gamma=0.9, lam=0.8)[rank::world_size], step=1, **step)
    assert stats.critic_lr == CRITIC.lr and stats.value_loss_sum > 0
    critic = {n: p.full_tensor().detach().clone() for n, p in trainer.critic.model.named_parameters()}
    policy = trainer.full_state_dict("float32")
    if rank == 0:
        torch.save({"values": values, "critic": critic, "policy": policy}, out_path)
    trainer.shutdown()


def test_two_ranks_match_one_rank(tmp_path):
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    run_distributed(_critic_step, path, str(tmp_path / "w1.pt"), world_size=1, init=False)
    run_distributed(_critic_step, path, str(tmp_path / "w2.pt"), world_size=2, init=False)
    one, two = torch.load(tmp_path / "w1.pt"), torch.load(tmp_path / "w2.pt")
    assert any(v != 0.0 for row in one["values"] for v in row), "the critic learned nothing in its first step"
    for a, b in zip(one["values"], two["values"]):
        assert a == pytest.approx(b, abs=1e-5)
    for name in one["critic"]:
        torch.testing.assert_close(one["critic"][name], two["critic"][name], atol=2e-5, rtol=1e-4)
    # the policy's second Adam step divides by moments of one step: an element whose gradient is ~0 moves by up to
    # lr x its summation-order noise over that noise, so the tolerance is the policy's, looser than the critic's
    for name in one["policy"]:
        torch.testing.assert_close(one["policy"][name], two["policy"][name], atol=1e-4, rtol=1e-3)


def _with_and_without(rank: int, world_size: int, port: int, model_path: str, out_path: str, critic: bool):
    trainer = _trainer(rank, world_size, port, model_path, CRITIC if critic else None)
    # fixed values: both trainers train the policy on the very same per-token advantages
    seqs = with_gae(SEQS, [[0.1 * (i + t) for t in range(len(s.response_ids))] for i, s in enumerate(SEQS)],
                    gamma=0.9, lam=0.8)
    num_tokens = sum(s.num_trained_tokens for s in SEQS)
    before = {n: p.full_tensor().detach().clone() for n, p in trainer.critic.model.named_parameters()} \
        if critic else {}
    trainer.train_step(seqs, step=0, num_tokens_all_ranks=num_tokens, num_micro_batches=_num_micro_batches(1),
                       num_seqs_all_ranks=len(SEQS))
    if critic:
        # the critic moved, and holds no gradient of the policy's: the two share no parameter
        assert any(not torch.equal(before[n], p.full_tensor()) for n, p in trainer.critic.model.named_parameters())
        policy_params = {id(p) for p in trainer.model.parameters()}
        assert not policy_params & {id(p) for p in trainer.critic.model.parameters()}
        # a critic loss alone puts no gradient on any policy parameter
        batch = trainer._collate(seqs[:2])
        loss, _ = trainer.critic.loss(batch, scale=batch.target_mask)
        loss.backward()
        assert all(p.grad is None for p in trainer.model.parameters())
        _offload_round_trip(trainer)
        _checkpoint_round_trip(trainer, out_path + ".ckpt")
    torch.save(trainer.full_state_dict("float32"), out_path)
    trainer.shutdown()


def _offload_round_trip(trainer) -> None:
    critic = [p.to_local().clone() for p in trainer.critic.model.parameters()]
    adam = [v.clone() for s in trainer.critic.optimizer.state.values() for v in s.values() if v.dim()]
    trainer.offload()
    assert all(p.to_local().untyped_storage().size() == 0 for p in trainer.critic.model.parameters())
    trainer.onload()
    assert all(torch.equal(a, p.to_local()) for a, p in zip(critic, trainer.critic.model.parameters()))
    adam_after = [v for s in trainer.critic.optimizer.state.values() for v in s.values() if v.dim()]
    assert all(torch.equal(a, b) for a, b in zip(adam, adam_after))


def _checkpoint_round_trip(trainer, directory: str) -> None:
    import os

    os.makedirs(directory, exist_ok=True)
    trainer.save_checkpoint(directory)
    saved = [p.to_local().clone() for p in trainer.critic.model.parameters()]
    adam = [v.clone() for s in trainer.critic.optimizer.state.values() for v in s.values() if v.dim()]
    with torch.no_grad():
        for p in trainer.critic.model.parameters():
            p.to_local().add_(1.0)
        for s in trainer.critic.optimizer.state.values():
            for v in s.values():
                if v.dim():
                    v.zero_()
    trainer.load_checkpoint(directory)
    assert all(torch.equal(a, p.to_local()) for a, p in zip(saved, trainer.critic.model.parameters()))
    adam_after = [v for s in trainer.critic.optimizer.state.values() for v in s.values() if v.dim()]
    assert all(torch.equal(a, b) for a, b in zip(adam, adam_after))


def test_the_critic_never_reaches_the_policy_and_round_trips(tmp_path):
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    run_distributed(_with_and_without, path, str(tmp_path / "with.pt"), True, world_size=1, init=False)
    run_distributed(_with_and_without, path, str(tmp_path / "without.pt"), False, world_size=1, init=False)
    with_critic, without = torch.load(tmp_path / "with.pt"), torch.load(tmp_path / "without.pt")
    assert with_critic.keys() == without.keys()
    assert all(torch.equal(with_critic[n], without[n]) for n in without)  # the policy's update, bit for bit


def test_bench_train_updates_measures_the_critics_share(tmp_path):
    """`colocate bench train --updates N` on the tiny model: its three variants run their optimizer steps, and the
    critic's share of time and state is measured, not assumed (the bench preset's figures: benchmarks/results)."""
    from colocate.bench.train_updates import run_updates_bench
    from colocate.config import JobConfig

    cfg = JobConfig(model=ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    result = run_updates_bench(cfg, num_updates=2, out_dir=str(tmp_path), name="updates")
    rows = result["rows"]
    assert [rows[v]["optimizer_steps"] for v in ("one_update", "n_updates", "ppo")] == [1, 2, 2]
    assert rows["one_update"]["critic_state_bytes"] == rows["n_updates"]["critic_state_bytes"] == 0
    assert rows["ppo"]["critic_state_bytes"] > 0 and rows["ppo"]["critic_update_s"] > 0
    assert "values_s" in rows["ppo"] and "recompute_s" in rows["n_updates"] and "recompute_s" not in rows["one_update"]
    assert 0 < result["critic_share_of_step_time"] < 1 and 0.3 < result["critic_share_of_resident_state"] < 0.6
    assert (tmp_path / "updates.json").is_file()
