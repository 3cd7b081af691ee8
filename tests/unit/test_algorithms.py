"""The algorithm family against hand-computed cases: advantages, aggregations, clips, GSPO, CISPO, the entropy
bonus, REINFORCE++'s returns, the overlong punishment and the learning-rate schedules. Every expected number is
worked out in the comments; gradients are checked against the derivative by hand (d ratio / d logp = ratio)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from colocate.config import AlgoConfig, TrainerConfig, load_config
from colocate.errors import ConfigError
from colocate.rl.advantages import estimate_advantages
from colocate.rl.samples import Answer, Group
from colocate.rl.scoring import Scored, ScoredGroup, keep_informative, overlong_punishment
from colocate.rl.tasks import Sample
from colocate.trainer.logprobs import processed_logprobs
from colocate.trainer.loss import Sequence, collate, policy_loss, token_scale
from colocate.trainer.lr_schedule import learning_rate
from colocate.trainer.token_returns import kl_returns, whiten_over_ranks

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _loss_and_grad(algo: AlgoConfig, seqs: list[Sequence], new_logprobs: list[float], **scale_args):
    """The loss and d loss / d logp of every response token, in order, with the trainer's logprobs `new`."""
    batch = collate(seqs, pad_id=0, device=CPU)
    logprobs = batch.old_logprobs.clone()
    logprobs[batch.target_mask.bool()] = torch.tensor(new_logprobs)
    logprobs.requires_grad_()
    scale = token_scale(batch, aggregation=algo.loss_aggregation, **scale_args) if scale_args else None
    loss, stats = policy_loss(logprobs, batch, algo=algo, scale=scale)
    loss.backward()
    return loss.item(), logprobs.grad[batch.target_mask.bool()].tolist(), stats


# ------------------------------------------------------------------------------------------------ advantages

def test_advantage_estimators_by_hand():
    # grpo: [1, 0, 1, 0] has mean 0.5, population std 0.5: (r - 0.5) / 0.5 = +-1
    grpo = estimate_advantages([[1.0, 0.0, 1.0, 0.0]], estimator="grpo")[0]
    assert grpo == pytest.approx([1, -1, 1, -1], rel=1e-5)
    # dr_grpo: [1, 0, 0] minus the mean 1/3, no std
    assert estimate_advantages([[1.0, 0.0, 0.0]], estimator="dr_grpo")[0] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    # rloo: the first's baseline is the others' mean (0 + 0) / 2 = 0; the others' is (1 + 0) / 2 = 0.5
    assert estimate_advantages([[1.0, 0.0, 0.0]], estimator="rloo")[0] == pytest.approx([1.0, -0.5, -0.5])
    # reinforce_pp: rewards 1 (2 tokens), 0 (1 token) | 0 (1 token), each counted per token: 1, 1, 0, 0 has mean
    # 0.5 and std 0.5, so the advantages are 1, -1 | -1; groups play no part
    pp = estimate_advantages([[1.0, 0.0], [0.0]], estimator="reinforce_pp", num_tokens=[[2, 1], [1]])
    assert pp[0] == pytest.approx([1, -1], rel=1e-5) and pp[1] == pytest.approx([-1], rel=1e-5)
    # with the KL in the reward the trainer shapes the returns: the driver passes the raw rewards
    assert estimate_advantages([[1.0, 0.0]], estimator="reinforce_pp", kl_in_reward=True) == [[1.0, 0.0]]


def test_a_uniform_group_has_zero_advantage_and_no_nan():
    for estimator in ("grpo", "dr_grpo", "rloo"):
        assert estimate_advantages([[0.3, 0.3, 0.3]], estimator=estimator)[0] == pytest.approx([0, 0, 0], abs=1e-9)


# ------------------------------------------------------------------------------------------------ aggregation

TWO = [Sequence([1], [2, 3], [-1.0, -1.0], 2.0), Sequence([1], [4], [-1.0], -1.0)]  # 3 tokens, 2 sequences


@pytest.mark.parametrize("aggregation, loss, grads", [
    # on-policy (ratio 1) each token's loss is -A: -2, -2, +1, and its gradient -A x its weight
    # token_mean: every token 1/3 -> (-2 - 2 + 1) / 3 = -1
    ("token_mean", -1.0, [-2 / 3, -2 / 3, 1 / 3]),
    # seq_mean_token_mean: the 2-token sequence's tokens weigh 1/(2 x 2), the other's 1/(2 x 1)
    # -> -2/4 - 2/4 + 1/2 = -0.5
    ("seq_mean_token_mean", -0.5, [-0.5, -0.5, 0.5]),
    # seq_mean_token_sum_norm with max_tokens 4: every token 1/(2 x 4) -> -3/8
    ("seq_mean_token_sum_norm", -3 / 8, [-0.25, -0.25, 0.125]),
])
def test_loss_aggregations(aggregation, loss, grads):
    value, grad, stats = _loss_and_grad(AlgoConfig(loss_aggregation=aggregation), TWO, [-1.0, -1.0, -1.0],
                                        num_tokens=3, num_seqs=2, max_tokens=4)
    assert value == pytest.approx(loss) and grad == pytest.approx(grads)
    assert stats.objective == pytest.approx(loss) and stats.loss_sum == pytest.approx(-3.0)  # the token sum


def test_aggregation_weights_sum_to_one_over_ranks():
    # each rank holds one sequence: the ranks' weights add up to 1 (token_mean, seq_mean_token_mean)
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        total = sum(float(token_scale(collate([s], pad_id=0, device=CPU), aggregation=aggregation, num_tokens=3,
                                      num_seqs=2, max_tokens=4).sum()) for s in TWO)
        assert total == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------ clipping

ONE_POS = [Sequence([1], [2], [math.log(0.4)], 1.0)]
ONE_NEG = [Sequence([1], [2], [math.log(0.4)], -1.0)]


def test_clip_higher_lets_a_positive_advantage_rise_further():
    # ratio 0.5 / 0.4 = 1.25, A = +1. Symmetric 0.2: clipped at 1.2 -> loss -1.2, no gradient.
    value, grad, stats = _loss_and_grad(AlgoConfig(clip_eps=0.2), ONE_POS, [math.log(0.5)])
    assert value == pytest.approx(-1.2) and grad == [0.0] and stats.clipped_sum == 1
    # clip-higher 0.28: 1.25 < 1.28, unclipped -> loss -1.25, gradient -A x ratio = -1.25
    value, grad, stats = _loss_and_grad(AlgoConfig(clip_eps_low=0.2, clip_eps_high=0.28), ONE_POS, [math.log(0.5)])
    assert value == pytest.approx(-1.25) and grad == pytest.approx([-1.25]) and stats.clipped_sum == 0


def test_clip_low_side_for_a_negative_advantage():
    # ratio 0.3 / 0.4 = 0.75, A = -1: -min(-0.75, -0.8) = 0.8, clipped (eps_low 0.2), no gradient
    value, grad, _ = _loss_and_grad(AlgoConfig(clip_eps_low=0.2, clip_eps_high=0.28), ONE_NEG, [math.log(0.3)])
    assert value == pytest.approx(0.8) and grad == [0.0]
    # eps_low 0.3: 0.75 > 0.7, unclipped: loss 0.75, gradient -A x ratio = 0.75
    value, grad, _ = _loss_and_grad(AlgoConfig(clip_eps_low=0.3, clip_eps_high=0.28), ONE_NEG, [math.log(0.3)])
    assert value == pytest.approx(0.75) and grad == pytest.approx([0.75])


def test_dual_clip_bounds_a_negative_advantage():
    # ratio 2.0 / 0.4 = 5, A = -1: PPO's loss is -min(-5, -1.2) = 5, gradient -A x ratio = 5
    value, grad, _ = _loss_and_grad(AlgoConfig(), ONE_NEG, [math.log(2.0)])
    assert value == pytest.approx(5.0) and grad == pytest.approx([5.0])
    # dual clip c = 3: min(5, 3 x |A|) = 3, constant in the ratio: no gradient
    value, grad, _ = _loss_and_grad(AlgoConfig(clip_ratio_c=3.0), ONE_NEG, [math.log(2.0)])
    assert value == pytest.approx(3.0) and grad == [0.0]
    # a positive advantage is untouched by it: ratio 1.25 clipped at 1.2 as before
    assert _loss_and_grad(AlgoConfig(clip_ratio_c=3.0), ONE_POS, [math.log(0.5)])[0] == pytest.approx(-1.2)


# ------------------------------------------------------------------------------------------------ GSPO, CISPO

def test_gspo_clips_the_sequence_ratio_not_the_tokens():
    # token ratios 1.1 and 1/1.1: their geometric mean is 1, inside GSPO's [1 - 3e-4, 1 + 4e-4]. A = +1.
    seqs = [Sequence([1], [2, 3], [math.log(0.5), math.log(0.5)], 1.0)]
    new = [math.log(0.55), math.log(0.5 / 1.1)]
    gspo = AlgoConfig(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4)
    value, grad, stats = _loss_and_grad(gspo, seqs, new)
    # each token's loss -s A = -1, its gradient -A x s = -1 (the token form: s's value, the token's gradient)
    assert value == pytest.approx(-2.0) and grad == pytest.approx([-1.0, -1.0]) and stats.clipped_sum == 0
    # token-level PPO with the same range clips the first token (1.1 > 1.0004: gradient 0) and not the second
    # (0.909 < 0.9997 with A > 0: min picks the unclipped 0.909, gradient -0.909)
    ppo = AlgoConfig(policy_loss="ppo", clip_eps_low=3e-4, clip_eps_high=4e-4)
    _, grad, _ = _loss_and_grad(ppo, seqs, new)
    assert grad == pytest.approx([0.0, -1 / 1.1])
    # sequence ratios 1.2 and 1.0 -> s = sqrt(1.2) = 1.095 > 1.0004: both tokens clipped, no gradient
    _, grad, stats = _loss_and_grad(gspo, seqs, [math.log(0.6), math.log(0.5)])
    assert grad == [0.0, 0.0] and stats.clipped_sum == 2


def test_cispo_keeps_the_gradient_of_a_clipped_token():
    # ratio 0.6 / 0.4 = 1.5, A = +1, eps_high 0.28: the weight is clip(1.5) = 1.28, a constant; the loss is
    # -1.28 x A x logp, so d loss / d logp = -1.28 (PPO's would be 0 here)
    cispo = AlgoConfig(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=0.28)
    value, grad, stats = _loss_and_grad(cispo, ONE_POS, [math.log(0.6)])
    assert value == pytest.approx(-1.28 * math.log(0.6)) and grad == pytest.approx([-1.28])
    assert stats.clipped_sum == 1
    # ratio 0.2 / 0.4 = 0.5 with no lower bound (eps_low 1.0: floor 0): weight 0.5, gradient -0.5
    _, grad, stats = _loss_and_grad(cispo, ONE_POS, [math.log(0.2)])
    assert grad == pytest.approx([-0.5]) and stats.clipped_sum == 0


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_tis_weights_every_policy_loss(policy_loss):
    # the trainer's logprob is 3x the engine's: w = 3, truncated at cap 2. With a correction the ratio is taken
    # against the trainer itself (1 in value), so each loss's gradient is -A x 1 x the weight 2 = -2
    algo = AlgoConfig(policy_loss=policy_loss, correction="tis", tis_cap=2.0)
    _, grad, stats = _loss_and_grad(algo, [Sequence([1], [2], [math.log(0.1)], 1.0)], [math.log(0.3)])
    assert grad == pytest.approx([-2.0]) and stats.corrected_sum == 1


# ------------------------------------------------------------------------------------------------ entropy

def test_entropy_bonus_gradient_is_that_of_the_entropy():
    # dH/dz_j = -p_j (log p_j + H) for a softmax over logits z
    logits = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]], requires_grad=True)
    _, entropy = processed_logprobs(logits, torch.tensor([[0, 1]]), entropy_grad=True)
    entropy[0, 0].backward()
    p = torch.softmax(logits[0, 0].detach(), -1)
    h = -(p * p.log()).sum()
    assert torch.allclose(logits.grad[0, 0], -p * (p.log() + h), atol=1e-6)
    assert logits.grad[0, 1].abs().sum() == 0
    # without the flag the entropy is a metric: no gradient
    assert not processed_logprobs(logits, torch.tensor([[0, 1]]))[1].requires_grad


def test_entropy_bonus_enters_the_loss():
    # on-policy, A = 0: the only term is -coef x H; with H = 0.7 on the token and coef 0.1 the loss is -0.07
    batch = collate([Sequence([1], [2], [-1.0], 0.0)], pad_id=0, device=CPU)
    entropy = torch.full_like(batch.old_logprobs, 0.7, requires_grad=True)
    loss, _ = policy_loss(batch.old_logprobs.clone(), batch, algo=AlgoConfig(entropy_coef=0.1), entropy=entropy)
    loss.backward()
    assert loss.item() == pytest.approx(-0.07) and entropy.grad[batch.target_mask.bool()].tolist() == \
        pytest.approx([-0.1])


# ------------------------------------------------------------------------------------------------ REINFORCE++

def test_kl_returns_sum_the_kl_to_each_answers_end():
    # one answer of 3 tokens, reward 1; k1 KL per token = logp_engine - logp_ref = 0.1, 0.2, 0.3; coef 1:
    # returns 1 - 0.6, 1 - 0.5, 1 - 0.3
    seqs = [Sequence([1], [2, 3, 4], [-1.0, -1.0, -1.0], 1.0), Sequence([1], [5], [-1.0], 0.0)]
    for packed in (False, True):  # packed: both answers in one row, and a suffix stops at its answer's end
        batch = collate(seqs, pad_id=0, device=CPU, packed=packed)
        ref = batch.old_logprobs.clone()
        row, first, _ = batch.spans[0]
        ref[row, first:first + 3] -= torch.tensor([0.1, 0.2, 0.3])
        returns = kl_returns(batch, ref, kl_coef=1.0, estimator="k1")
        assert returns[batch.target_mask.bool()].tolist() == pytest.approx([0.4, 0.5, 0.7, 0.0])


def test_whitening_on_one_rank():
    # returns 0.4, 0.5, 0.7, 0.0 (mask) and an off-mask 9: mean 0.4, population std sqrt(0.065)
    r = torch.tensor([[0.4, 0.5, 0.7, 0.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    (out,) = whiten_over_ranks([r], [m])
    std = math.sqrt((0 + 0.01 + 0.09 + 0.16) / 4)
    assert out[0].tolist() == pytest.approx([0.0, 0.1 / std, 0.3 / std, -0.4 / std, 0.0], abs=1e-5)


# ------------------------------------------------------------------------------------------------ overlong, groups

def test_overlong_punishment():
    # max 10, buffer 4: nothing up to 6 tokens, then -(excess / 4) x penalty, -penalty at 10
    assert [overlong_punishment(n, max_tokens=10, buffer=4, penalty=1.0) for n in (5, 6, 8, 10)] == \
        pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_punishment(9, max_tokens=10, buffer=4, penalty=0.5) == pytest.approx(-0.375)
    assert overlong_punishment(10, max_tokens=10, buffer=0, penalty=1.0) == 0.0
    # an answer whose budget the context cut to 3 (under the buffer): punished from its first token to its end
    assert overlong_punishment(3, max_tokens=3, buffer=4, penalty=1.0) == pytest.approx(-0.75)


def test_dynamic_sampling_judges_a_group_by_its_task_rewards_not_its_length_punishment():
    # every answer right (1.0) but of different lengths: the punishment tells them apart, DAPO's filter does not
    group = _group([0.9, 0.5])
    group.task_rewards = [1.0, 1.0]
    assert not group.informative
    group.task_rewards = [1.0, 0.0]
    assert group.informative


def _group(rewards, finish=None):
    answers = [Answer(0, 4, [7] * (i + 1), [-1.0] * (i + 1), finish_reason=(finish or ["stop"] * len(rewards))[i])
               for i in range(len(rewards))]
    return ScoredGroup(Group(Sample("p", "a"), [1], answers), list(rewards), ["x"] * len(rewards))


def test_dynamic_sampling_trains_only_groups_whose_rewards_differ():
    groups = [_group([1.0, 1.0]), _group([1.0, 0.0]), _group([0.0, 0.0]), _group([0.0, 0.5]), _group([0.2, 0.0])]
    assert len(Scored.from_groups(groups, algo=AlgoConfig()).sequences) == 10  # no filter: every group trains
    # two groups wanted: the first two informative ones (the second and fourth); the fifth is surplus
    assert keep_informative(groups, num_groups=2) == (2, 1)
    assert [g.trained for g in groups] == [False, True, False, True, False]
    scored = Scored.from_groups(groups, algo=AlgoConfig(dynamic_sampling=True))
    # advantages +-1 in each kept group; the rewards reported are every group's
    assert [s.advantage for s in scored.sequences] == pytest.approx([1, -1, -1, 1], rel=1e-5)
    assert scored.rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.2, 0.0]


def test_mask_truncated_keeps_the_answer_in_its_groups_baseline():
    # rewards 1, 0, 0 with the second truncated: dr_grpo's mean 1/3 still counts it, its sequence is not trained
    group = _group([1.0, 0.0, 0.0], finish=["stop", "length", "stop"])
    scored = Scored.from_groups([group], algo=AlgoConfig(advantage="dr_grpo", mask_truncated=True))
    assert [s.advantage for s in scored.sequences] == pytest.approx([2 / 3, -1 / 3])
    assert [len(s.response_ids) for s in scored.sequences] == [1, 3]
    assert scored.stats()["truncated_fraction"] == pytest.approx(1 / 3) and scored.num_masked == 1


# ------------------------------------------------------------------------------------------------ schedules

def test_learning_rate_schedules():
    def lrs(schedule):
        cfg = TrainerConfig(lr=1.0, lr_schedule=schedule, lr_warmup_steps=2, lr_min_ratio=0.1)
        return [learning_rate(s, cfg, num_steps=6) for s in range(6)]

    # warmup 2: (s + 1) / 3 for s = 0, 1; then the decay's progress (s - 2) / 3 over steps 2..5
    assert lrs("constant") == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    # linear: 1 - 0.9 x progress
    assert lrs("linear") == pytest.approx([1 / 3, 2 / 3, 1, 0.7, 0.4, 0.1])
    # cosine: 0.1 + 0.9 x (1 + cos(pi x progress)) / 2, progress 1/3 -> 0.775, 2/3 -> 0.325
    assert lrs("cosine") == pytest.approx([1 / 3, 2 / 3, 1, 0.775, 0.325, 0.1])


# ------------------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("overrides, needles", [
    (["algo.clip_eps_high=-0.5"], ["algo.clip_eps_high=-0.5 is invalid", "[0.8, 0.5], low > high"]),
    (["algo.clip_eps_low=1.5"], ["algo.clip_eps_low=1.5 is invalid", "below 0"]),
    (["algo.advantage=ppo_gae"], ["algo.advantage='ppo_gae' is invalid", "grpo, dr_grpo, rloo, reinforce_pp"]),
    (["algo.clip_ratio_c=3", "algo.policy_loss=gspo"], ["algo.clip_ratio_c=3.0", "policy_loss=gspo has none"]),
    (["algo.clip_ratio_c=0.5"], ["algo.clip_ratio_c=0.5", "must be > 1"]),
    (["algo.kl_in_reward=true", "algo.kl_coef=0.1"], ["algo.kl_in_reward=True", "algo.advantage=reinforce_pp"]),
    (["algo.kl_in_reward=true", "algo.advantage=reinforce_pp"], ["algo.kl_in_reward=True", "algo.kl_coef > 0"]),
    (["rollout.num_samples=1"], ["rollout.num_samples=1 is invalid", "every advantage is 0"]),
    (["rollout.num_samples=1", "algo.advantage=rloo"], ["rollout.num_samples=1", "algo.advantage=rloo"]),
    (["rollout.temperature=0"], ["rollout.temperature=0.0 is invalid", "greedy"]),
    (["algo.overlong_buffer=3"], ["algo.overlong_buffer=3", "smaller than rollout.max_tokens=3"]),
    (["algo.mask_truncated=true", "rollout.ignore_eos=true"], ["algo.mask_truncated=True", "ignore_eos"]),
    (["trainer.lr_min_ratio=2"], ["trainer.lr_min_ratio=2.0", "[0, 1]"]),
    (["trainer.lr_schedule=step"], ["trainer.lr_schedule='step'", "constant, cosine, linear"]),
    (["algo.dynamic_sampling=true", "algo.advantage=reinforce_pp"], ["algo.dynamic_sampling=True", "batch baseline"]),
    (["rollout.max_refill_passes=-1"], ["rollout.max_refill_passes=-1", "must be >= 0"]),
], ids=lambda v: "_".join(v) if isinstance(v, list) and "=" in v[0] else None)
def test_bad_algorithm_settings_are_one_line(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_what_a_user_may_mean_is_accepted():
    # REINFORCE++'s batch baseline learns from one sample a prompt; CISPO's unbounded low side is clip_eps_low=1
    load_config(None, ["rollout.num_samples=1", "algo.advantage=reinforce_pp"])
    load_config(None, ["algo.policy_loss=cispo", "algo.clip_eps_low=1.0", "algo.clip_eps_high=0.28"])


PRESETS = {  # each preset's defining keys, as its paper sets them
    "grpo": dict(advantage="grpo", loss_aggregation="seq_mean_token_mean", kl_coef=0.04),
    "dapo": dict(advantage="grpo", clip_low=0.2, clip_high=0.28, dynamic_sampling=True, kl_coef=0.0),
    "dr_grpo": dict(advantage="dr_grpo", loss_aggregation="seq_mean_token_sum_norm"),
    "gspo": dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4, loss_aggregation="seq_mean_token_mean"),
    "cispo": dict(policy_loss="cispo", clip_low=1.0, clip_high=0.28, loss_aggregation="token_mean"),
    "rloo": dict(advantage="rloo"),
    "reinforce_pp": dict(advantage="reinforce_pp", kl_in_reward=True, kl_estimator="k1"),
    "ppo": dict(advantage="gae", gamma=1.0, lam=0.95, num_epochs=2, old_logprobs="recompute"),
}


def test_every_preset_is_listed():
    assert sorted(p.stem for p in (ROOT / "configs" / "algos").glob("*.yaml")) == sorted(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_compose_with_the_default_job(preset):
    base = load_config(str(ROOT / "configs" / "default.yaml"))
    cfg = load_config([str(ROOT / "configs" / "default.yaml"), str(ROOT / "configs" / "algos" / f"{preset}.yaml")])
    assert {key: getattr(cfg.algo, key) for key in PRESETS[preset]} == PRESETS[preset]
    # a preset sets the algorithm, not the job (DAPO's refill bound is a rollout key)
    assert dataclasses.replace(cfg.rollout, max_refill_passes=base.rollout.max_refill_passes) == base.rollout
    assert (cfg.model, cfg.engine, cfg.trainer) == (base.model, base.engine, base.trainer)


def test_validate_prints_the_merged_preset(capsys):
    from colocate.cli import main

    code = main(["validate", str(ROOT / "configs" / "default.yaml"), str(ROOT / "configs" / "algos" / "dapo.yaml"),
                 "algo.num_steps=7"])
    out = capsys.readouterr().out
    assert code == 0
    # the job's file, then the preset's keys, then the override
    assert "dynamic_sampling: true" in out and "clip_eps_high: 0.28" in out and "num_steps: 7" in out
    assert "task: copy" in out
