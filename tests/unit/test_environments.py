"""Multi-turn episodes (rollout.env): the pool runs turns with a scripted engine, token in and token out; the
environment's observations are masked out of the loss (their gradient is exactly 0); its failures are named by
sample and turn, fail the step or drop the group; a restored pool replays its environments; bad input is one
line before any actor starts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from colocate.config import AlgoConfig, RolloutConfig, load_config
from colocate.engine.requests import EngineRequest, RequestResult
from colocate.errors import ConfigError, EnvError
from colocate.job.checks import check_sources
from colocate.rollout.environments import CopyTurns, Episodes
from colocate.rollout.pool import RolloutPool
from colocate.rl.samples import Group
from colocate.rl.scoring import reward_groups
from colocate.rl.tasks import Sample
from colocate.trainer.loss import Sequence, collate, policy_loss, token_scale

EOS = 2
TEXT = {str(d): 10 + d for d in range(10)} | {"=": 20}
CHARS = {v: k for k, v in TEXT.items()}


def tokenize(text: str) -> list[int]:
    return [TEXT[c] for c in text]


def decode(tokens: list[int]) -> str:
    return "".join(CHARS.get(t, "?") for t in tokens)


class Scripted:
    """An environment whose observations say the turn number; reward = the turn's length; done after 3 turns."""

    def __init__(self):
        self.actions: list[str] = []

    def reset(self, sample):
        return sample.prompt

    def step(self, action):
        self.actions.append(action)
        return f"{len(self.actions)}=", float(len(action)), len(self.actions) == 3


def make_pool(factory=Scripted, *, num_samples=2, max_tokens=40, env_errors="fail", timeout_s=5.0, max_model_len=128,
              **rollout):
    cfg = RolloutConfig(num_prompts=1, num_samples=num_samples, max_tokens=max_tokens, env="x:y",
                        env_errors=env_errors, **rollout)
    episodes = Episodes(factory, tokenize=tokenize, decode=decode, timeout_s=timeout_s)
    return RolloutPool(cfg, max_model_len=max_model_len, episodes=episodes, eos_token_id=EOS)


def engine_pass(pool: RolloutPool, turns: dict, version: int = 0) -> list[EngineRequest]:
    """One pass of a scripted engine: answer (group, i) says turns[(group, i)][k] at its k-th turn, then EOS."""
    requests = pool.requests(version)
    results = []
    for r in requests:
        answer = pool.groups[0].answers[r.index]
        said = turns[r.index][len(answer.turn_rewards)]
        tokens = (tokenize(said) + [EOS])[:r.max_tokens]
        stopped = tokens[-1] == EOS
        results.append(RequestResult(r.request_id, tokens, [-0.5] * len(tokens), "stop" if stopped else "length", 0))
    pool.apply(requests, results, version)
    return requests


def test_turns_append_the_engines_tokens_and_the_observations_masked():
    pool = make_pool()
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    turns = {0: ["1", "22", "333"], 1: ["4", "55", "666"]}
    requests = engine_pass(pool, turns)
    assert [r.prompt_ids for r in requests] == [tokenize("7=")] * 2  # the prompt is the environment's reset
    engine_pass(pool, turns)
    engine_pass(pool, turns, version=1)
    answer = pool.groups[0].answers[0]
    # exactly what the engine sampled, turn by turn, and what the environment said between: never re-tokenised
    assert answer.token_ids == tokenize("1") + [EOS] + tokenize("1=") + tokenize("22") + [EOS] + tokenize("2=") + \
        tokenize("333") + [EOS]
    assert answer.mask == [1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert answer.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5, -0.5]
    assert answer.versions[-4:] == [1] * 4 and answer.turn_rewards == [1.0, 2.0, 3.0]
    assert answer.finish_reason == "stop" and pool.num_complete() == 1  # the environment said done
    assert pool.episodes.envs[(0, 1)].actions == ["4", "55", "666"]  # each turn's text, the EOS left out
    # the second pass continued from the whole answer so far
    assert pool.requests(0) == []
    [group] = reward_groups([Group(g.sample, g.prompt_ids, g.answers) for g in pool.take()], reward_fn=None,
                            decode=decode, eos_id=EOS, turn_reward="sum")
    assert group.rewards == [6.0, 6.0]
    # the episode's text: every turn and observation, less the EOS ending each turn (not cut at the first)
    assert group.responses[0] == "11=222=333"
    assert pool.episodes.envs == {}  # taken: their environments are let go


def test_max_turns_the_turn_limit_and_the_budget_end_an_episode():
    pool = make_pool(max_turns=2)
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    turns = {0: ["1", "2"], 1: ["3", "4"]}
    engine_pass(pool, turns)
    engine_pass(pool, turns)
    assert [a.finish_reason for a in pool.groups[0].answers] == ["stop", "stop"]
    assert [len(a.turn_rewards) for a in pool.groups[0].answers] == [2, 2]

    pool = make_pool(max_turn_tokens=2)  # a turn cut at 2 tokens is a turn's end, not the episode's
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    turns = {0: ["111", "222", "333"], 1: ["444", "555", "666"]}
    requests = engine_pass(pool, turns)
    assert [r.max_tokens for r in requests] == [2, 2] and all(r.final for r in requests)
    answer = pool.groups[0].answers[0]
    assert answer.token_ids[:4] == tokenize("11") + tokenize("1=") and not answer.done

    pool = make_pool(max_tokens=5)  # the observation does not fit: the episode ends, cut ("length")
    pool.top_up([(Sample("7=", "7"), [], [5, 5])])
    engine_pass(pool, {0: ["12"], 1: ["34"]})
    assert [a.finish_reason for a in pool.groups[0].answers] == ["length", "length"]


def test_rewards_sum_or_last():
    pool = make_pool()
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    turns = {0: ["1", "22", "333"], 1: ["", "5", "66"]}
    for _ in range(3):
        engine_pass(pool, turns)
    groups = [Group(g.sample, g.prompt_ids, g.answers) for g in pool.take()]
    assert reward_groups(groups, reward_fn=None, decode=decode, eos_id=EOS, turn_reward="last")[0].rewards == \
        [3.0, 2.0]


def test_observation_tokens_carry_no_gradient():
    seqs = [Sequence([5], [7, 8, 9, 10, 11], [-1.0, -2.0, 0.0, 0.0, -1.5], 1.0, mask=[1, 1, 0, 0, 1]),
            Sequence([5], [7, 8], [-1.0, -1.0], -1.0)]
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))
    assert batch.target_mask.tolist()[0] == [1, 1, 0, 0, 1]
    assert batch.num_trained == [3, 2]
    # GRPO's per-sequence mean divides by the tokens trained: 3 for the episode, not its 5 response tokens
    scale = token_scale(batch, aggregation="seq_mean_token_mean", num_tokens=5, num_seqs=2, max_tokens=8)
    assert scale[0].tolist() == pytest.approx([1 / 6, 1 / 6, 0, 0, 1 / 6])
    logprobs = batch.old_logprobs.clone().requires_grad_()  # ratio 1: nothing clipped
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        logprobs.grad = None
        algo = AlgoConfig(loss_aggregation=aggregation)
        scale = token_scale(batch, aggregation=aggregation, num_tokens=5, num_seqs=2, max_tokens=8)
        loss, stats = policy_loss(logprobs, batch, algo=algo, scale=scale)
        loss.backward()
        assert logprobs.grad[0, 2].item() == 0.0 and logprobs.grad[0, 3].item() == 0.0, aggregation
        assert logprobs.grad[0, 0].item() != 0.0 and logprobs.grad[0, 4].item() != 0.0
        assert stats.tokens == 5  # the trained tokens: observations not counted


def test_a_failing_environment_is_named_and_fails_the_step_or_drops_its_group():
    class Raises(Scripted):
        def step(self, action):
            raise KeyError("boom")

    pool = make_pool(Raises)
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    with pytest.raises(EnvError, match=r"^environment \(rollout.env\) step raised KeyError: 'boom', on sample '7=' at "
                                       r"turn 0$"):
        engine_pass(pool, {0: ["1"], 1: ["2"]})

    pool = make_pool(Raises, env_errors="drop")
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    engine_pass(pool, {0: ["1"], 1: ["2"]})
    assert pool.groups == [] and pool.stats.num_env_dropped == 1 and pool.episodes.envs == {}

    class Hangs(Scripted):
        def step(self, action):
            time.sleep(3)

    pool = make_pool(Hangs, timeout_s=0.2)
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    with pytest.raises(EnvError, match=r"step took more than rollout.env_timeout_s=0.2 s, on sample '7=' at turn 0$"):
        engine_pass(pool, {0: ["1"], 1: ["2"]})


@pytest.mark.parametrize("returned, message", [
    ("text", r"step returned str 'text'; expected a tuple \(observation, reward, done\)"),
    (("1=", float("nan"), False), r"step returned reward nan; expected a finite number"),
    (("1=", 1.0, "no"), r"step returned done 'no'; expected True or False"),
    ((3.5, 1.0, False), r"step returned float 3.5 as an observation; expected text or a list of token ids"),
])
def test_a_wrong_type_from_step_is_named(returned, message):
    class Wrong(Scripted):
        def step(self, action):
            return returned

    pool = make_pool(Wrong)
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    with pytest.raises(EnvError, match=message + r", on sample '7=' at turn 0$"):
        engine_pass(pool, {0: ["1"], 1: ["2"]})


def test_an_async_environment_and_token_observations():
    class Async(Scripted):
        async def reset(self, sample):
            self.loop = asyncio.get_running_loop()  # what a client session binds to
            return tokenize(sample.prompt)

        async def step(self, action):
            assert asyncio.get_running_loop() is self.loop, "step runs on reset's event loop"
            self.actions.append(action)
            return [TEXT["9"]], 1.0, len(self.actions) == 2

    pool = make_pool(Async)
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    engine_pass(pool, {0: ["1", "2"], 1: ["3", "4"]})
    engine_pass(pool, {0: ["1", "2"], 1: ["3", "4"]})
    assert pool.groups[0].answers[0].token_ids == tokenize("1") + [EOS, TEXT["9"]] + tokenize("2") + [EOS]
    assert pool.num_complete() == 1


def test_a_restored_pool_replays_its_environments():
    pool = make_pool()
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    turns = {0: ["1", "22", "333"], 1: ["4", "55", "666"]}
    engine_pass(pool, turns)
    engine_pass(pool, turns)
    restored = make_pool()
    restored.load_state(pool.state())
    assert restored.episodes.envs[(0, 0)].actions == ["1", "22"]  # stepped again through the finished turns
    engine_pass(restored, turns)
    engine_pass(pool, turns)
    assert [a.token_ids for a in restored.groups[0].answers] == [a.token_ids for a in pool.groups[0].answers]


def test_copy_turns_rewards_each_copy_and_shows_the_next_digits():
    env = CopyTurns(length=3, num_turns=2)
    assert env.reset(Sample("407=", "407")) == "407="
    observation, reward, done = env.step("407")
    assert reward == 1.0 and not done and len(observation) == 4 and observation.endswith("=")
    observation2, reward2, done2 = env.step(observation[:-1][::-1] + "9")
    assert done2 and observation2 == "" and 0 <= reward2 < 1


@pytest.mark.parametrize("env, message", [
    ("nowhere:make", "rollout.env='nowhere:make' is invalid: cannot import 'nowhere'"),
    ("tests.unit.test_environments:reset_returns_a_number",
     "rollout.env='tests.unit.test_environments:reset_returns_a_number' is invalid: environment (rollout.env) reset "
     "returned int 7 as a prompt; expected text or a list of token ids, on sample '"),
    ("tests.unit.test_environments:step_returns_a_list",
     "rollout.env='tests.unit.test_environments:step_returns_a_list' is invalid: environment (rollout.env) step "
     "returned list [1, 2]; expected a tuple (observation, reward, done), on sample '"),
])
def test_bad_environments_are_one_line_before_any_actor(env, message):
    with pytest.raises(ConfigError) as raised:
        check_sources(load_config(None, [f"rollout.env={env}"]), writes_here=False)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_env_keys_that_cannot_go_with_an_environment_are_refused():
    with pytest.raises(ConfigError, match=r"^rollout.reward_fn='m:f' is invalid: rollout.env is set"):
        load_config(None, ["rollout.env=copy_turns", "rollout.reward_fn=m:f"])
    with pytest.raises(ConfigError, match=r"^rollout.ignore_eos=True is invalid: a turn of rollout.env ends at"):
        load_config(None, ["rollout.env=copy_turns", "rollout.ignore_eos=true"])
    with pytest.raises(ConfigError, match=r"^rollout.env_workers=2 is invalid: holds rollout.env's environments, and "
                                          "rollout.env is empty"):
        load_config(None, ["rollout.env_workers=2"])


class _ResetReturnsANumber(Scripted):
    def reset(self, sample):
        return 7


class _StepReturnsAList(Scripted):
    def step(self, action):
        return [1, 2]


def reset_returns_a_number():
    return _ResetReturnsANumber()


def step_returns_a_list():
    return _StepReturnsAList()


class _NeedsDataAnswers(Scripted):
    def reset(self, sample):
        if not str(sample.answer).startswith("row-"):
            raise ValueError(f"not a row of my data: {sample.answer!r}")
        return sample.prompt


def needs_data_answers():
    return _NeedsDataAnswers()


def test_an_environment_on_data_rows_is_checked_on_the_first_row(tmp_path, monkeypatch):
    """On data.train_files the probe takes a row of the data (an environment may read its own fields), not a
    toy prompt: before any actor, in read_inputs, once the rows are read."""
    import json

    import datasets

    from colocate.job.checks import read_inputs
    from colocate.models.sources import ensure_model, load_tokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    path = tmp_path / "train.jsonl"
    cache = f"model.cache_dir={Path(__file__).parents[2] / '.cache' / 'models'}"
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": f"row-{i}"}) + "\n" for i in range(16)))
    good = load_config(None, ["rollout.env=tests.unit.test_environments:needs_data_answers", cache,
                              f"data.train_files={path}"])
    check_sources(good, writes_here=False)  # no toy prompt was tried
    model_path = ensure_model(good.model)
    read_inputs(good, model_path, load_tokenizer(model_path))
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(16)))
    with pytest.raises(ConfigError, match=r"^rollout.env='tests.unit.test_environments:needs_data_answers' is "
                                          r"invalid: environment \(rollout.env\) reset raised ValueError: not a row"):
        read_inputs(good, model_path, load_tokenizer(model_path))


def test_an_empty_observation_still_separates_two_turns():
    class Silent(Scripted):
        def step(self, action):
            self.actions.append(action)
            return "", 1.0, len(self.actions) == 3

    pool = make_pool(Silent, max_turn_tokens=2)
    pool.top_up([(Sample("7=", "7"), [], [40, 40])])
    turns = {0: ["11", "22", "33"], 1: ["44", "55", "66"]}
    for _ in range(2):
        engine_pass(pool, turns)
    answer = pool.groups[0].answers[0]
    assert answer.actions() == [tokenize("11"), tokenize("22"), []] and answer.turn_starts == [0, 2, 4]
    assert pool.requests(0)[0].max_tokens == 2  # the turn going on is the third, not the first two run together
    restored = make_pool(Silent, max_turn_tokens=2)
    restored.load_state(pool.state())
    assert restored.episodes.envs[(0, 0)].actions == ["11", "22"]
    engine_pass(pool, turns)
    assert pool.episodes.envs[(0, 0)].actions == ["11", "22", "33"] and pool.num_complete() == 1


def test_with_partial_rollout_an_episode_must_fit_the_lag_cap():
    with pytest.raises(ConfigError, match=r"^rollout.max_turns=4 is invalid: with partial rollout an episode can take "
                                          r"max_turns - 1 \+ ceil\(max_tokens / partial_tokens\) = 5 passes, more "
                                          r"than rollout.max_lag \+ 1 = 2 policy versions"):
        load_config(None, ["rollout.env=copy_turns", "rollout.max_turns=4", "rollout.max_tokens=12",
                           "rollout.partial_tokens=6", "rollout.max_lag=1"])
    load_config(None, ["rollout.env=copy_turns", "rollout.max_turns=4", "rollout.max_tokens=12",
                       "rollout.partial_tokens=6", "rollout.max_lag=4"])


def test_drop_mode_tops_the_step_up_and_fails_when_most_samples_fail():
    """Through Passes.generate, with a scripted engine: a dropped group is replaced within the step; an
    environment that fails on every sample ends the step in one line after 4x the groups in flight."""
    from colocate.rollout.passes import Passes
    from colocate.rl.tasks import PromptStream, make_task

    calls = {"n": 0}

    class FailsOnce(Scripted):
        def step(self, action):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("flaky")
            return "", 1.0, True

    class Always(Scripted):
        def reset(self, sample):
            raise RuntimeError("down")

    for factory, fails in ((FailsOnce, False), (Always, True)):
        cfg = load_config(None, ["rollout.env=copy_turns", "rollout.env_errors=drop", "rollout.num_prompts=2",
                                 "rollout.num_samples=2", "rollout.max_tokens=8"])
        rollouts = Passes(cfg, engines=[None], tokenizer=_Tokenizer(),
                            prompts=PromptStream(make_task("copy", length=3)))
        rollouts.pool.episodes.factory = factory
        rollouts.run_pass = lambda plan: [{"results": _say(plan.per_engine[0], "1"), "timeline": []}]
        if fails:
            with pytest.raises(EnvError, match=r"^rollout.env_errors=drop dropped 10 groups since the last step took "
                                               r"its own, more than 4x the 2 in flight: .* reset raised RuntimeError: "
                                               r"down"):
                rollouts.generate(0)
        else:
            rollouts.generate(0)
            assert rollouts.pool.num_complete() == 2 and rollouts.pool.stats.num_env_dropped == 1


class _Tokenizer:
    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=tokenize(text))

    def decode(self, tokens):
        return decode(tokens)


def _say(requests, text):
    return [RequestResult(r.request_id, tokenize(text) + [EOS], [-0.1] * (len(text) + 1), "stop", 0) for r in requests]
