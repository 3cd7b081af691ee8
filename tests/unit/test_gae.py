"""PPO's critic side on one process: GAE against a trajectory computed by hand (gamma and lambda not 1), multi-turn
observations skipped, the step's whitening, the critic's clipped value loss and its gradient kept from the policy,
and the config's refusals (each one line, before any actor starts)."""

from __future__ import annotations

import math

import pytest
import torch

from colocate.config import AlgoConfig, CriticConfig, JobConfig, RolloutConfig
from colocate.errors import ConfigError
from colocate.rl.advantages import estimate_advantages
from colocate.rl.gae import gae, whiten, with_gae
from colocate.rl.samples import Sequence
from colocate.trainer.batching import collate


def test_gae_against_a_trajectory_computed_by_hand():
    # values 0.5, 0.2, 0.4; reward 1 at the last token; gamma 0.9, lambda 0.8; V after the end = 0
    # t=2: delta = 1 + 0.9 x 0 - 0.4 = 0.6                         A = 0.6
    # t=1: delta = 0 + 0.9 x 0.4 - 0.2 = 0.16                      A = 0.16 + 0.72 x 0.6 = 0.592
    # t=0: delta = 0 + 0.9 x 0.2 - 0.5 = -0.32                     A = -0.32 + 0.72 x 0.592 = 0.10624
    advantages, returns = gae(reward=1.0, values=[0.5, 0.2, 0.4], trained=None, gamma=0.9, lam=0.8)
    assert advantages == pytest.approx([0.10624, 0.592, 0.6], abs=1e-12)
    assert returns == pytest.approx([0.60624, 0.792, 1.0], abs=1e-12)  # A + V: the critic's targets


def test_lambda_one_is_the_discounted_return_minus_the_value_and_zero_the_td_error():
    values, reward, gamma = [0.3, -0.1, 0.7, 0.2], 2.0, 0.9
    mc, _ = gae(reward=reward, values=values, trained=None, gamma=gamma, lam=1.0)
    assert mc == pytest.approx([reward * gamma ** (3 - t) - v for t, v in enumerate(values)], abs=1e-12)
    td, _ = gae(reward=reward, values=values, trained=None, gamma=gamma, lam=0.0)
    nxt = values[1:] + [0.0]
    assert td == pytest.approx([(reward if t == 3 else 0.0) + gamma * nxt[t] - values[t] for t in range(4)])


def test_observation_tokens_are_skipped_and_get_nothing():
    # turn 1: tokens 0, 1; an observation: tokens 2, 3; turn 2: token 4. The trajectory is tokens 0, 1, 4.
    values, mask = [0.5, 0.2, 9.0, 9.0, 0.4], [1, 1, 0, 0, 1]
    advantages, returns = gae(reward=1.0, values=values, trained=mask, gamma=0.9, lam=0.8)
    alone, alone_returns = gae(reward=1.0, values=[0.5, 0.2, 0.4], trained=None, gamma=0.9, lam=0.8)
    assert [advantages[t] for t in (0, 1, 4)] == alone and advantages[2:4] == [0.0, 0.0]
    assert [returns[t] for t in (0, 1, 4)] == alone_returns and returns[2:4] == [0.0, 0.0]


def test_whitening_counts_every_trained_token_of_the_step_once():
    adv = [[1.0, 2.0, 3.0], [4.0, 100.0]]
    out = whiten(adv, [None, [1, 0]])
    flat = [1.0, 2.0, 3.0, 4.0]
    mean, std = sum(flat) / 4, math.sqrt(sum((a - sum(flat) / 4) ** 2 for a in flat) / 4)
    assert out[0] == pytest.approx([(a - mean) / std for a in adv[0]])
    assert out[1] == [pytest.approx((4.0 - mean) / std), 0.0]


def test_the_estimator_passes_rewards_on_and_with_gae_fills_each_sequence():
    assert estimate_advantages([[1.0, 0.0], [0.5]], estimator="gae") == [[1.0, 0.0], [0.5]]
    seqs = [Sequence([1], [2, 3], [-1.0, -1.0], 1.0), Sequence([1], [4, 5, 6], [-1.0] * 3, 0.0, mask=[1, 0, 1])]
    values = [[0.1, 0.2], [0.3, 0.4, 0.5]]
    out = with_gae(seqs, values, gamma=1.0, lam=0.95)
    raw = [gae(reward=s.advantage, values=v, trained=s.mask, gamma=1.0, lam=0.95) for s, v in zip(seqs, values)]
    assert [s.token_advantages for s in out] == whiten([a for a, _ in raw], [s.mask for s in seqs])
    assert [s.returns for s in out] == [r for _, r in raw] and [s.old_values for s in out] == values
    batch = collate(out, pad_id=0, device=torch.device("cpu"))
    row, first, num = batch.spans[1]
    assert batch.advantages[row, first:first + num].tolist() == pytest.approx(out[1].token_advantages)
    assert batch.returns[row, first:first + num].tolist() == pytest.approx(out[1].returns)
    assert batch.old_values[row, first:first + num].tolist() == pytest.approx(values[1])


def job(**keys) -> JobConfig:
    algo = {k: v for k, v in keys.items() if not k.startswith("critic_")}
    critic = {k.removeprefix("critic_"): v for k, v in keys.items() if k.startswith("critic_")}
    return JobConfig(algo=AlgoConfig(**algo), critic=CriticConfig(**critic), rollout=RolloutConfig(num_samples=1))


@pytest.mark.parametrize("keys, needle", [
    ({"advantage": "gae"}, "critic.model_path='' is invalid: algo.advantage=gae estimates"),
    ({"advantage": "grpo", "critic_model_path": "policy"}, "critic.model_path='policy' is invalid: a critic trains"),
    ({"advantage": "gae", "critic_model_path": "policy", "dynamic_sampling": True},
     "algo.dynamic_sampling=True is invalid: drops groups whose rewards are all equal, which a group baseline gives "
     "no gradient; algo.advantage=gae has a learned value baseline"),
    ({"advantage": "reinforce_pp", "lam": 0.9}, "algo.lam=0.9 is invalid: sets GAE"),
    ({"advantage": "gae", "critic_model_path": "policy", "gamma": 1.5}, "algo.gamma=1.5 is invalid: must be in"),
    ({"advantage": "gae", "critic_model_path": "policy", "critic_value_clip": -1}, "critic.value_clip=-1"),
])
def test_bad_critic_keys_are_one_line(keys, needle):
    cfg = job(**keys)
    if keys.get("advantage") == "grpo":
        cfg.rollout.num_samples = 2
    with pytest.raises(ConfigError) as e:
        cfg.check()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_lora_critic_is_refused_and_gae_needs_no_group():
    cfg = job(advantage="gae", critic_model_path="policy")
    cfg.check()  # one sample a prompt: GAE's baseline is the critic's
    cfg.trainer.lora.rank = 8
    with pytest.raises(ConfigError, match="trainer.lora.rank=8 is invalid: trains adapters, .* a LoRA critic is not"):
        cfg.check()


def _tiny_lm(path, *, vocab_size=None, head_width=None):
    """A tiny Qwen2 causal LM saved at `path`; `head_width`: with a value head score.weight [1, head_width]."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from colocate.models.sources import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=vocab_size or len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    if head_width is not None:
        weights = load_file(str(path / "model.safetensors"))
        save_file({**weights, "score.weight": torch.full((1, head_width), 0.5), "score.bias": torch.ones(1)},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _classifier(path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    Qwen2ForSequenceClassification(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               num_labels=1)).save_pretrained(path)
    return path


def test_a_value_model_of_its_own_is_checked_and_loads_its_head(tmp_path):
    from colocate.job.checks import check_critic
    from colocate.models.dims import model_dims
    from colocate.trainer.critic import value_model

    cfg = job(advantage="gae", critic_model_path="policy")
    dims = model_dims(cfg)
    good = _tiny_lm(tmp_path / "good", head_width=32)
    cfg.critic.model_path = str(good)
    check_critic(cfg, dims)
    head = value_model(str(good), attention="sdpa").get_output_embeddings()
    assert torch.equal(head.weight, torch.full((1, 32), 0.5)) and torch.equal(head.bias, torch.ones(1))
    fresh = value_model(str(_tiny_lm(tmp_path / "fresh")), attention="sdpa").get_output_embeddings()
    assert not fresh.weight.any() and not fresh.bias.any()  # no saved head: it starts at 0
    for path, needle in [(_tiny_lm(tmp_path / "wide", head_width=48), "its value head score.weight has shape "
                          "[1, 48], and its hidden size 32 needs [1, 32]"),
                         (_tiny_lm(tmp_path / "vocab", vocab_size=dims.vocab_size + 8), f"its vocabulary has "
                          f"{dims.vocab_size + 8} tokens and the policy's {dims.vocab_size}"),
                         (tmp_path / "nowhere", "not a local Hugging Face model directory"),
                         (_classifier(tmp_path / "rm"), "Qwen2ForSequenceClassification is not a causal LM")]:
        cfg.critic.model_path = str(path)
        with pytest.raises(ConfigError) as e:
            check_critic(cfg, dims)
        assert str(e.value).startswith(f"critic.model_path='{path}' is invalid: ") and needle in str(e.value)
        assert "\n" not in str(e.value)
