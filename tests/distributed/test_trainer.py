"""The FSDP2 trainer on gloo: a GRPO step over 2 ranks (each with half the sequences) updates the weights the
same as 1 rank with all of them: gradient averaging and the all-rank token normalisation are right."""

from __future__ import annotations

import pytest
import torch

from colocate.config import AlgoConfig, ModelConfig, RolloutConfig, TrainerConfig
from colocate.models.sources import ensure_model
from colocate.rl.samples import Sequence
from tests.distributed.conftest import run_distributed

SEQS = [
    Sequence([5, 6, 16], [5, 6, 2], [-3.0, -3.5, -4.0], 1.0),
    Sequence([7, 8, 16], [9], [-3.2], -1.0),
    Sequence([5, 16], [5, 2], [-3.9, -3.1], 0.7),
    Sequence([9, 9, 9, 16], [9, 9, 9, 2], [-3.0] * 4, -0.7),
    Sequence([6, 16], [6, 6], [-3.3, -3.3], 0.2),
]


def _train(rank: int, world_size: int, port: int, model_path: str, out_path: str, algo, sampling,
           chunk_tokens: int | None = 1024, checkpointed: bool = False, layout: dict | None = None):
    from colocate.trainer.actor import TrainerActor
    from colocate.trainer.batching import trainer_micro_batches

    cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, grad_clip=0.0, logprob_chunk_tokens=chunk_tokens,
                        activation_checkpointing=checkpointed, **(layout or {}))
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0, algo=algo,
                           sampling=sampling)
    trainer.setup("127.0.0.1", port)
    assert (trainer.reference is not None) == (algo.kl_coef > 0)  # no reference policy unless the KL is on
    num_tokens = sum(len(s.response_ids) for s in SEQS)
    # as the driver counts them (job/groups.py): the most micro-batches of any rank's share
    num_micro_batches = max(len(trainer_micro_batches(SEQS[r::world_size], cfg)) for r in range(world_size))
    stats = trainer.train_step(SEQS[rank::world_size], step=0, num_tokens_all_ranks=num_tokens,
                               num_micro_batches=num_micro_batches, num_seqs_all_ranks=len(SEQS))
    assert stats.tokens == sum(len(s.response_ids) for s in SEQS[rank::world_size])
    assert len(stats.token_log_w) == stats.tokens and len(stats.seq_log_w) == len(SEQS[rank::world_size])
    grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}
    state = trainer.full_state_dict("float32")
    losses = [torch.zeros(()) for _ in range(world_size)]
    if world_size > 1:
        torch.distributed.all_gather(losses, torch.tensor(stats.loss_sum))
    if rank == 0:
        torch.save({"grads": grads, "state": state, "loss": float(sum(losses)) if world_size > 1 else stats.loss_sum},
                   out_path)
    trainer.shutdown()


@pytest.mark.parametrize("algo, sampling", [
    pytest.param(AlgoConfig(), RolloutConfig(), id="ppo_against_the_engine"),
    # the engine logprobs above are far from the tiny model's (log w up to ~7): sequence weights get truncated
    pytest.param(AlgoConfig(correction="tis", correction_level="sequence", tis_cap=2.0),
                 RolloutConfig(temperature=0.8), id="tis_sequence_temperature"),
    # k1's gradient is 1 per token even where the policy is the reference: the KL term's normalisation over
    # ranks (and rank 1's dummy reference forward) is checked, not only its value 0
    pytest.param(AlgoConfig(kl_coef=0.5, kl_estimator="k1"), RolloutConfig(), id="kl_k1"),
    # the algorithm family (docs/algorithms.md): each aggregation's normaliser counts every rank's tokens or
    # sequences; GSPO's sequence ratio and CISPO's weight are per rank's own sequences. The clips are wide: the
    # engine logprobs above are far from the tiny model's, and a clipped token has no gradient to compare.
    pytest.param(AlgoConfig(policy_loss="gspo", clip_eps_low=0.9, clip_eps_high=50.0,
                            loss_aggregation="seq_mean_token_mean"), RolloutConfig(), id="gspo_seq_mean"),
    pytest.param(AlgoConfig(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=50.0, entropy_coef=0.1,
                            loss_aggregation="seq_mean_token_sum_norm"), RolloutConfig(max_tokens=8),
                 id="cispo_dr_grpo_norm_entropy"),
    # REINFORCE++'s KL-shaped returns are whitened over both ranks' tokens (one all-reduce), and the dual clip
    pytest.param(AlgoConfig(advantage="reinforce_pp", kl_in_reward=True, kl_coef=0.5, kl_estimator="k1",
                            clip_eps=50.0, clip_ratio_c=60.0), RolloutConfig(), id="reinforce_pp_kl_in_reward"),
])
def test_two_ranks_match_one_rank(tmp_path, algo, sampling):
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    run_distributed(_train, path, str(tmp_path / "w1.pt"), algo, sampling, world_size=1, init=False)
    run_distributed(_train, path, str(tmp_path / "w2.pt"), algo, sampling, world_size=2, init=False)
    one, two = torch.load(tmp_path / "w1.pt"), torch.load(tmp_path / "w2.pt")
    from transformers import AutoModelForCausalLM

    before = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert any(not torch.equal(one["state"][n], before[n]) for n in before), "the step changed nothing"
    for name, grad in one["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=1e-7)
    # Adam's first step is about lr * sign(grad): the weights agree wherever the gradient is not ~0.
    for name, weight in one["state"].items():
        torch.testing.assert_close(two["state"][name], weight, rtol=0, atol=2 * 1e-2)


def test_chunked_logprobs_and_checkpointed_layers_under_fsdp_give_the_plain_gradients(tmp_path):
    # The chunked head inside FSDP2's root group: its recompute in the backward reads the root's full weights
    # and its gradient reaches the reduce-scatter (trainer/logprobs.py); chunks of 2 tokens split every sequence.
    # Checkpointed layers: FSDP2's hooks run again in the recompute, in PRE_BACKWARD (trainer/fsdp.py).
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    sampling = RolloutConfig(temperature=0.8, top_p=0.9)
    # each alone is tests/unit's (test_logprobs.py, test_activation_checkpointing.py); here both under FSDP2
    runs = {"plain": (None, False), "both": (2, True)}
    for name, (chunk, checkpointed) in runs.items():
        run_distributed(_train, path, str(tmp_path / f"{name}.pt"), AlgoConfig(), sampling, chunk, checkpointed,
                        world_size=2, init=False)
    plain = torch.load(tmp_path / "plain.pt")
    for name in ("both",):
        other = torch.load(tmp_path / f"{name}.pt")
        for param, grad in plain["grads"].items():
            assert grad.abs().max() > 0, param
            torch.testing.assert_close(other["grads"][param], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {param}")


def test_packed_and_token_budget_micro_batches_give_the_padded_update(tmp_path):
    # Packed: one row per micro-batch, positions restarting, attention kept inside each sequence by
    # transformers' masking from position_ids (sdpa on the CPU). A token budget regroups the same sequences
    # (first-fit decreasing); the loss is still normalised by all ranks' tokens, so the update is the same.
    # Top-p and temperature on, a sequence-level correction (its per-sequence sums read the packed rows).
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    algo = AlgoConfig(correction="tis", correction_level="sequence", tis_cap=2.0)
    sampling = RolloutConfig(temperature=0.8, top_p=0.9)
    runs = {"padded": {}, "packed": {"pack_sequences": True},
            "budget": {"max_tokens_per_micro_batch": 8},  # padded rows x longest <= 8: one or two a pass
            "packed_budget": {"pack_sequences": True, "max_tokens_per_micro_batch": 12}}
    for name, layout in runs.items():
        run_distributed(_train, path, str(tmp_path / f"{name}.pt"), algo, sampling, 4, False, layout,
                        world_size=2, init=False)
    padded = torch.load(tmp_path / "padded.pt")
    for name in runs:
        other = torch.load(tmp_path / f"{name}.pt")
        assert other["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-6), name
        for param, grad in padded["grads"].items():
            assert grad.abs().max() > 0, param
            torch.testing.assert_close(other["grads"][param], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {param}")


def test_bf16_compute_on_the_cpu_keeps_fp32_master_state_and_gradients(tmp_path):
    # FSDP2 mixed precision on gloo: bf16 gathers and compute, fp32 reduce-scatter into the fp32 shards. The job
    # refuses it on a CPU without native bf16 (job/placement.py: emulated, it is slower than fp32), but the
    # path is the same on any CPU, so its numbers are checked here on whatever runs the tests.
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    for name, layout in {"fp32": {}, "bf16": {"mixed_precision": True}}.items():
        run_distributed(_train, path, str(tmp_path / f"{name}.pt"), AlgoConfig(), RolloutConfig(), 1024, False,
                        layout, world_size=2, init=False)
    fp32, bf16 = torch.load(tmp_path / "fp32.pt"), torch.load(tmp_path / "bf16.pt")
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2)
    for param, grad in fp32["grads"].items():
        assert bf16["grads"][param].dtype == torch.float32 and bf16["state"][param].dtype == torch.float32
        # bf16 keeps 8 bits of mantissa: within a few percent of the parameter's largest gradient
        assert (bf16["grads"][param] - grad).abs().max() <= 0.05 * grad.abs().max(), param
        assert not torch.equal(bf16["grads"][param], grad), f"{param}: the same as fp32, bf16 did not run"


def _offload_round_trip(rank: int, world_size: int, port: int, model_path: str):
    from colocate.host.memory import process_rss_bytes
    from colocate.trainer.actor import TrainerActor

    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, offload="true")
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0)
    trainer.setup("127.0.0.1", port)
    num_tokens = sum(len(s.response_ids) for s in SEQS)
    trainer.train_step(SEQS[rank::world_size], step=0, num_tokens_all_ranks=num_tokens, num_micro_batches=2,
                       num_seqs_all_ranks=len(SEQS))
    trainer.release_grads()
    before = {k: v.clone() for k, v in trainer.full_state_dict("float32").items()}
    adam = [v.to_local().clone() for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
    state_bytes = sum(t.numel() * t.element_size() for t in trainer._state_tensors())
    rss = process_rss_bytes()
    moved = trainer.offload()
    dropped = rss - process_rss_bytes()
    assert moved >= state_bytes and dropped >= 0.95 * state_bytes, (moved, dropped, state_bytes)
    assert trainer.onload() == moved
    after = trainer.full_state_dict("float32")
    assert all(torch.equal(before[k], after[k]) for k in before)
    adam_after = [v.to_local() for s in trainer.optimizer.state.values() for v in s.values() if v.dim()]
    assert all(torch.equal(a, b) for a, b in zip(adam, adam_after))
    # training goes on from the restored state (FSDP2's shard views survived the release)
    trainer.train_step(SEQS[rank::world_size], step=0, num_tokens_all_ranks=num_tokens, num_micro_batches=2,
                       num_seqs_all_ranks=len(SEQS))
    trainer.shutdown()


def test_offload_frees_the_trainer_state_and_restores_it_exactly(tmp_path):
    # big enough that its tensors come from mmap'd allocations the OS takes back (~9M parameters)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colocate.models.sources import build_tokenizer

    path = tmp_path / "model"
    config = Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    run_distributed(_offload_round_trip, str(path), world_size=2, init=False)


def _whiten(rank: int, world_size: int, out_path: str):
    from colocate.trainer.token_returns import whiten_over_ranks

    returns = torch.tensor([[0.4, 0.5, 0.7, 0.0], [1.5, -2.0, 3.0, 9.0]])
    masks = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    rows = [0, 1] if world_size == 1 else [rank]  # two ranks: a row each
    out = whiten_over_ranks([returns[r:r + 1] for r in rows], [masks[r:r + 1] for r in rows])
    gathered = [torch.zeros(1, 4) for _ in range(world_size)]
    if world_size > 1:
        torch.distributed.all_gather(gathered, out[0])
        out = gathered
    if rank == 0:
        torch.save(torch.cat(out), out_path)


def test_token_returns_are_whitened_over_every_ranks_tokens(tmp_path):
    run_distributed(_whiten, str(tmp_path / "one.pt"), world_size=1)
    run_distributed(_whiten, str(tmp_path / "two.pt"), world_size=2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    torch.testing.assert_close(two, one)
    assert one[1, 3] == 0 and one[0].abs().sum() > 0  # off the mask stays 0


def _head_logits(rank: int, world_size: int, port: int, model_path: str, out_path: str, fp32_lm_head: bool):
    import torch.nn.functional as F

    from colocate.trainer.actor import TrainerActor
    from colocate.trainer.logprobs import processed_logprobs

    cfg = TrainerConfig(micro_batch_size=8, mixed_precision=True, fp32_lm_head=fp32_lm_head)
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0)
    info = trainer.setup("127.0.0.1", port)
    seen = {}

    def check(head, args, output):
        # what FSDP2 handed the head (its pre-forward hook runs first: the all-gathered, cast weight and inputs),
        # and the head's output against the two ways to make logits from them
        hidden, weight = args[0].reshape(-1, args[0].shape[-1]), head.weight
        targets = head._scoring[0].reshape(-1)
        fp32 = processed_logprobs(F.linear(hidden.float(), weight.float()), targets)[0]
        rounded = processed_logprobs(F.linear(hidden, weight), targets)[0]
        got = output[..., 0].reshape(-1)
        seen.update(hidden=hidden.dtype, weight=weight.dtype, fp32=torch.equal(got, fp32),
                    rounded=torch.equal(got, rounded), gap=float((fp32 - rounded).abs().max()))

    trainer.model.lm_head.register_forward_hook(check)
    trainer.score(SEQS[rank::world_size], num_micro_batches=1, temperature=1.0, top_p=1.0)
    if rank == 0:
        torch.save({**seen, "logits_dtype": info["logits_dtype"]}, out_path)
    trainer.shutdown()


def test_the_head_computes_its_logits_in_fp32_when_asked(tmp_path):
    # trainer.fp32_lm_head under bf16 mixed precision: the head's logits are fp32 products of the bf16 hidden
    # states and weight FSDP2 gives it (vLLM's head_dtype=float32 on the engine), bit for bit; without it, bf16
    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path / "models")))
    for fp32 in (True, False):
        run_distributed(_head_logits, path, str(tmp_path / f"{fp32}.pt"), fp32, world_size=2, init=False)
    on, off = torch.load(tmp_path / "True.pt"), torch.load(tmp_path / "False.pt")
    assert on["hidden"] == on["weight"] == off["hidden"] == torch.bfloat16  # the same inputs either way
    assert on["fp32"] and not on["rounded"] and on["logits_dtype"] == "float32"
    assert off["rounded"] and not off["fp32"] and off["logits_dtype"] == "bfloat16"
    assert on["gap"] > 0  # the two differ on this model: the check above can tell them apart


def _routed(seqs: list[Sequence]) -> list[Sequence]:
    """SEQS with a routing of every position but the last: expert (position + k + layer) mod 8, no router's
    own choice (so replaying it changes the forward)."""
    import numpy as np

    out = []
    for s in seqs:
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        rows = (np.arange(n)[:, None, None] + np.arange(2)[None, :, None] + 3 * np.arange(2)[None, None, :]) % 8
        out.append(Sequence(s.prompt_ids, s.response_ids, s.logprobs, s.advantage, routing=rows.astype(np.uint16)))
    return out


def _replayed_step(rank: int, world_size: int, port: int, model_path: str, out_path: str, routed: bool):
    from colocate.trainer.actor import TrainerActor

    cfg = TrainerConfig(lr=1e-2, micro_batch_size=2, grad_clip=0.0, activation_checkpointing=True)
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0,
                           algo=AlgoConfig(router_replay=True, clip_eps=50.0))
    trainer.setup("127.0.0.1", port)
    seqs = _routed(SEQS) if routed else SEQS
    mine = seqs[rank::world_size]
    # every rank's forward used exactly the rows given, the last position its router's own choice
    for s, (_, own, used) in zip(mine, trainer.score_routing(mine, num_micro_batches=3, temperature=1.0, top_p=1.0)):
        if routed:
            assert (used[:-1] == s.routing).all() and (used[-1] == own[-1]).all()
        else:
            assert (used == own).all()
    trainer.train_step(mine, step=0, num_tokens_all_ranks=sum(len(s.response_ids) for s in SEQS),
                       num_micro_batches=3, num_seqs_all_ranks=len(SEQS))
    grads = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}
    if rank == 0:
        torch.save(grads, out_path)
    trainer.shutdown()


def test_router_replay_under_fsdp_and_checkpointing_routes_as_given_and_two_ranks_match_one(tmp_path):
    # algo.router_replay on tiny-moe: the replayed rows reach every layer of every rank (and the recomputation of a
    # checkpointed layer in the backward: otherwise its gradients would be those of another routing)
    path = ensure_model(ModelConfig(preset="tiny-moe", cache_dir=str(tmp_path / "models")))
    for world_size, routed in ((1, True), (2, True), (1, False)):
        run_distributed(_replayed_step, path, str(tmp_path / f"{world_size}{routed}.pt"), routed,
                        world_size=world_size, init=False)
    one, two, free = (torch.load(tmp_path / name) for name in ("1True.pt", "2True.pt", "1False.pt"))
    for name, grad in one.items():
        torch.testing.assert_close(two[name], grad, rtol=1e-4, atol=1e-7)
    experts = [n for n in one if "experts" in n]
    assert experts and any(not torch.equal(one[n], free[n]) for n in experts)  # the replay changed the update
    gates = [n for n in one if n.endswith("mlp.gate.weight")]
    assert gates and all(one[n].abs().sum() > 0 for n in gates)  # the routers still learn under replay
