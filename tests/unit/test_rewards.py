"""Built-in rewards, weighted combinations with per-reward means, batched rewards, and refused reward values."""

from __future__ import annotations

import math

import pytest

from colocate.config import AlgoConfig, load_config
from colocate.errors import ConfigError, RewardError
from colocate.job.checks import check_sources
from colocate.rl import rewards
from colocate.rl.rewards import (
    CombinedReward,
    exact_reward,
    final_answer,
    format_reward,
    make_reward,
    math_reward,
    parse_rewards,
)
from colocate.rl.samples import Answer, Group
from colocate.rl.scoring import RewardBreakdown, apply_reward, score
from colocate.rl.tasks import Sample, make_task

HAS_MATH_VERIFY = rewards._math_verify() is not None


def length_reward(prompt: str, response: str, answer: str) -> float:
    """A user plug-in by dotted path."""
    return float(len(response))


def batched_len(prompts, responses, answers):
    return [float(len(r)) for r in responses]


batched_len.batched = True


def nan_reward(prompt, response, answer):
    return float("nan") if response == "bad" else 1.0


def text_reward(prompt, response, answer):
    return "1.0"


# ----------------------------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("response, expected", [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, braces nested
    ("answer: 7 because 3+4", "7"),                            # a stated answer beats a later number
    ("3 apples and 4 more make 7", "7"),                        # else the last number
    ("it costs 1,000 coins", "1,000"),
    ("12-7", "7"),                                              # a minus after a digit is subtraction
    ("answer: -3", "-3"),
    ("no number here", None),
    ("\\boxed{12", "12"),                                       # an unclosed box: the last number
])
def test_final_answer(response, expected):
    assert final_answer(response) == expected


def test_math_reward_boxed_and_last_number():
    assert math_reward("2+2=", "\\boxed{4}", "4") == 1.0
    assert math_reward("2+2=", "i think 3, no: 4", "4") == 1.0
    assert math_reward("2+2=", "4 or 5", "4") == 0.0
    assert math_reward("2+2=", "", "4") == 0.0
    assert math_reward("", "1,000", "1000") == 1.0
    assert math_reward("", "-3", "-3") == 1.0


def test_math_reward_equivalent_forms():
    assert math_reward("", "\\boxed{1/2}", "0.5") == 1.0  # equal rationals, with or without math-verify
    assert math_reward("", "0.50", "1/2") == 1.0
    assert math_reward("", "\\boxed{0.4}", "1/2") == 0.0


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify is not installed")
def test_math_reward_latex_with_math_verify():
    assert math_reward("", "\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert math_reward("", "\\boxed{\\frac{1}{3}}", "0.5") == 0.0


def test_math_reward_without_math_verify_compares_numbers_exactly(monkeypatch):
    monkeypatch.setattr(rewards, "_math_verify", lambda: None)
    assert math_reward("", "\\boxed{1/2}", "0.5") == 1.0
    assert math_reward("", "so 2,500", "2500") == 1.0
    assert math_reward("", "\\boxed{x+1}", "x+1") == 1.0  # not numbers: equal text
    assert math_reward("", "\\boxed{\\frac{1}{2}}", "0.5") == 0.0  # LaTeX needs math-verify
    assert math_reward("", "0.3333", "1/3") == 0.0


def test_exact_and_format():
    assert exact_reward("", " 42\n", "42") == 1.0 and exact_reward("", "42.0", "42") == 0.0
    assert format_reward("", "\\boxed{4}", "") == 1.0
    assert format_reward("", "so, answer: 12", "") == 1.0
    assert format_reward("", "Answer : -1/2", "") == 1.0
    assert format_reward("", "12", "") == 0.0 and format_reward("", "\\boxed{ }", "") == 0.0


# ------------------------------------------------------------------------------------------ parsing the spec


def test_parse_weights_defaults_and_plugins():
    parts = parse_rewards("math:1.0, format:0.1,char,tests.unit.test_rewards:length_reward:-0.5")
    assert [(c.name, c.weight) for c in parts] == [("math", 1.0), ("format", 0.1), ("char", 1.0),
                                                   ("length_reward", -0.5)]
    assert parse_rewards("tests.unit.test_rewards:length_reward")[0].fn is length_reward


@pytest.mark.parametrize("spec, needle", [
    ("maths:1", "unknown reward 'maths'; valid: comma-separated name[:weight] with names math, exact, format, char"),
    ("math:heavy", "the weight of 'math' is 'heavy'"),
    ("math:nan", "finite"),
    ("math,,format", "empty component"),
    ("math:1,math:0.5", "listed twice"),
    ("no_such_module_xyz:f:1", "cannot import"),
])
def test_bad_specs_are_one_line(spec, needle):
    with pytest.raises(ConfigError) as info:
        parse_rewards(spec)
    assert needle in str(info.value) and "rollout.rewards" in str(info.value) and "\n" not in str(info.value)


def test_config_validates_rewards():
    assert load_config(None, ["rollout.rewards=math:1.0,format:0.1"]).rollout.rewards == "math:1.0,format:0.1"
    with pytest.raises(ConfigError, match="rollout.rewards.*unknown reward"):
        check_sources(load_config(None, ["rollout.rewards=bogus"]))
    with pytest.raises(ConfigError, match="rollout.reward_fn is set too"):
        load_config(None, ["rollout.rewards=math", "rollout.reward_fn=tests.unit.test_rewards:length_reward"])


def test_make_reward_keeps_the_old_choices():
    task = make_task("copy", length=3)
    assert make_reward(load_config(None, []), task) == task.reward
    cfg = load_config(None, ["rollout.reward_fn=tests.unit.test_rewards:length_reward"])
    assert make_reward(cfg, task) is length_reward
    assert isinstance(make_reward(load_config(None, ["rollout.rewards=math"]), task), CombinedReward)


# ------------------------------------------------------------------------------------ scoring with components


def _groups(responses_per_group: list[list[str]], answer: str = "4") -> list[Group]:
    groups = []
    for responses in responses_per_group:
        completions = [Answer(seed=0, max_tokens=8, token_ids=[ord(c) for c in r], logprobs=[0.0] * len(r))
                       for r in responses]
        groups.append(Group(Sample("2+2=", answer), [1, 2], completions))
    return groups


def _decode(ids):
    return "".join(map(chr, ids))


def test_weighted_combination_and_per_reward_means():
    reward = CombinedReward(parse_rewards("math:1.0,format:0.5"))
    scored = score(_groups([["answer: 4", "4", "answer: 5", "x"]]), reward_fn=reward, decode=_decode, eos_id=None,
                   algo=AlgoConfig(advantage="dr_grpo"))
    assert scored.rewards == [1.5, 1.0, 0.5, 0.0]
    stats = scored.stats()
    assert stats["reward_mean"] == 0.75
    assert stats["reward_math_mean"] == 0.5 and stats["reward_format_mean"] == 0.5
    assert [s.advantage for s in scored.sequences] == [0.75, 0.25, -0.25, -0.75]


def test_plain_reward_fn_stats_are_unchanged():
    scored = score(_groups([["4", "5"]]), reward_fn=exact_reward, decode=_decode, eos_id=None,
                   algo=AlgoConfig(advantage="dr_grpo"))
    assert scored.components == {}
    assert not [k for k in scored.stats() if k.startswith("reward_") and k.endswith("_mean") and k != "reward_mean"]


def test_batched_reward_sees_the_whole_step_once():
    calls = []

    def counting(prompts, responses, answers):
        calls.append(len(responses))
        return [float(len(r)) for r in responses]

    counting.batched = True
    scored = score(_groups([["a", "bb"], ["ccc", ""]]), reward_fn=counting, decode=_decode, eos_id=None,
                   algo=AlgoConfig(advantage="dr_grpo"))
    assert calls == [4] and scored.rewards == [1.0, 2.0, 3.0, 0.0]
    assert [s.advantage for s in scored.sequences] == [-0.5, 0.5, 1.5, -1.5]  # per group, not per step


def test_batched_component_in_a_combination():
    reward = CombinedReward(parse_rewards("tests.unit.test_rewards:batched_len:2,exact"))
    out = reward(["p", "p"], ["4", "44"], ["4", "4"])
    assert out == RewardBreakdown([3.0, 4.0], {"batched_len": [1.0, 2.0], "exact": [1.0, 0.0]})


@pytest.mark.parametrize("fn, needle", [
    (nan_reward, "returned nan (not finite) on prompt '2+2=', response 'bad'"),
    (text_reward, "returned '1.0' (not a number) on prompt '2+2=', response 'ok'"),
    (lambda p, r, a: None, "returned None (not a number)"),
    (lambda p, r, a: float("inf"), "not finite"),
])
def test_non_numbers_and_nan_are_refused_naming_the_sample(fn, needle):
    responses = ["ok", "bad"] if fn is nan_reward else ["ok"]
    with pytest.raises(RewardError) as info:
        score(_groups([responses]), reward_fn=fn, decode=_decode, eos_id=None, algo=AlgoConfig())
    assert needle in str(info.value)


def test_component_errors_name_the_reward_and_sample():
    reward = CombinedReward(parse_rewards("math,tests.unit.test_rewards:nan_reward:0.1"))
    with pytest.raises(RewardError, match=r"reward 'nan_reward' returned nan .* response 'bad'"):
        apply_reward(reward, ["2+2=", "2+2="], ["4", "bad"], ["4", "4"])


def test_batched_reward_of_the_wrong_length_or_raising():
    def short(prompts, responses, answers):
        return [1.0]

    short.batched = True
    with pytest.raises(RewardError, match="returned 1 values for 2 samples"):
        apply_reward(short, ["a", "b"], ["1", "2"], ["1", "2"])

    def broken(prompts, responses, answers):
        raise ValueError("sandbox down")

    broken.batched = True
    with pytest.raises(RewardError, match="batched reward function raised ValueError: sandbox down on 2 samples"):
        apply_reward(broken, ["a", "b"], ["1", "2"], ["1", "2"])


def test_a_batched_reward_with_a_nan_is_refused_naming_its_sample():
    def half_nan(prompts, responses, answers):
        return [1.0, float("nan")]

    half_nan.batched = True
    with pytest.raises(RewardError, match=r"returned nan \(not finite\) on prompt 'b', response '2'"):
        apply_reward(half_nan, ["a", "b"], ["1", "2"], ["1", "2"])


def test_values_accept_bools_and_numpy():
    import numpy as np

    values, _ = apply_reward(lambda p, r, a: r == a, ["p"] * 2, ["1", "2"], ["1", "1"])
    assert values == [1.0, 0.0]
    values, _ = apply_reward(lambda p, r, a: np.float32(0.25), ["p"], ["1"], ["1"])
    assert values == [0.25] and all(isinstance(v, float) and math.isfinite(v) for v in values)
