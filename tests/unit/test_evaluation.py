"""Evaluation: the pass@k estimator against brute force, when to evaluate, the Evaluator against a fake transport at
the engine boundary (round-robin split, reassembly, greedy vs sampled, budgets, the primary reward), the eval set
(toy task or val files), and the eval.* keys' checks."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest

from colocate.config import EvalConfig, load_config
from colocate.errors import ConfigError, RewardError
from colocate.models.sources import build_tokenizer
from colocate.rollout.evaluation import TOY_PROMPTS, Evaluator, make_evaluator, pass_at_k, should_evaluate
from colocate.rl.rewards import make_reward
from colocate.rl.tasks import Sample, make_task


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # the embedded models' character tokenizer, as written into every preset


def brute_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The share of k-subsets of n answers (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_brute_force_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    n, c, k = 1000, 3, 500  # C(1000, 500) ~ 1e299: the ratio as floats would overflow or lose everything
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(10, 4, 1) == pytest.approx(0.4)  # pass@1 is the fraction correct
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 6, 5) == 1.0


def test_should_evaluate():
    def when(**kw) -> list[int]:
        return [d for d in range(11) if should_evaluate(EvalConfig(**kw), d, 10)]

    assert when() == []
    assert when(at_start=True) == [0]
    assert when(every_steps=4) == [4, 8]
    assert when(every_steps=4, at_end=True, at_start=True) == [0, 4, 8, 10]
    assert when(every_steps=5, at_end=True) == [5, 10]  # the last step once
    assert when(at_end=True) == [10]


class FakeEngines:
    """The transport at the engine boundary: records the calls and answers each prompt with `answer(prompt
    text, sample index)` as tokens, then EOS and junk after it (which the text must not include)."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer, self.calls = tokenizer, answer, []

    def __call__(self, calls):
        self.calls.extend(calls)
        eos = self.tokenizer.eos_token_id
        out = []
        for _engine, prompts, sampling in calls:
            out.append([])
            for ids in prompts:
                prompt = self.tokenizer.decode(ids)
                answers = []
                for i in range(sampling["n"]):
                    text = self.answer(prompt, i)
                    tokens = self.tokenizer(text, add_special_tokens=False).input_ids
                    tokens = (tokens + [eos] + tokens[:1])[:sampling["max_tokens"]]
                    answers.append({"token_ids": tokens, "logprobs": [0.0] * len(tokens),
                                    "finish_reason": "stop" if eos in tokens else "length"})
                out[-1].append(answers)
        return out


def evaluator(tokenizer, overrides: list[str], samples: list[Sample], answer, num_engines: int = 2):
    cfg = load_config(None, ["eval.at_start=true", *overrides])
    fake = FakeEngines(tokenizer, answer)
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    return Evaluator(cfg, [object()] * num_engines, tokenizer, samples, make_reward(cfg, task), generate_fn=fake), fake


def copy_samples(*prompts: str) -> list[Sample]:
    return [Sample(f"{p}=", p) for p in prompts]


def test_greedy_sends_one_sample_at_temperature_0_split_round_robin_and_reassembled(tokenizer):
    samples = copy_samples("123", "456", "789", "111", "222")
    right = {"123=", "789=", "222="}  # by prompt text: a misplaced answer would score as wrong

    ev, fake = evaluator(tokenizer, ["rollout.max_tokens=5"], samples,
                         lambda p, i: p[:-1] if p in right else "9")
    result = ev.run()
    assert [(e, [tokenizer.decode(p) for p in prompts]) for e, prompts, _ in fake.calls] == [
        (0, ["123=", "789=", "222="]), (1, ["456=", "111="])]
    for _, _, sampling in fake.calls:
        assert sampling == {"n": 1, "temperature": 0.0, "top_p": 1.0, "seed": 1234, "max_tokens": 5}
    assert result["pass_at_1"] == pytest.approx(3 / 5)
    assert "pass_at_2" not in result and result["num_samples"] == 1 and result["num_prompts"] == 5
    # "9" against a 3-digit answer scores 0 (char match); the right answers 1 each
    assert result["reward_mean"] == pytest.approx(3 / 5)
    assert result["response_len_mean"] == pytest.approx((3 * 5 + 2 * 3) / 5)  # answer + EOS + 1 junk token, cut at 5
    assert result["truncated_fraction"] == 0.0 and result["seconds"] >= 0


def test_sampled_pass_at_k_counts_correct_answers_per_prompt(tokenizer):
    samples = copy_samples("123", "456", "789")
    num_right = {"123=": 0, "456=": 1, "789=": 3}  # of 4 answers each; wrong ones get one digit of three right

    def answer(prompt, i):
        return prompt[:-1] if i < num_right[prompt] else prompt[0] + "00"

    ev, fake = evaluator(tokenizer, ["eval.num_samples=4", "eval.temperature=0.7", "eval.max_tokens=4",
                                     "rollout.top_p=0.9"], samples, answer, num_engines=1)
    result = ev.run()
    assert [s for _, _, s in fake.calls] == [{"n": 4, "temperature": 0.7, "top_p": 0.9, "seed": 1234, "max_tokens": 4}]
    assert result["pass_at_1"] == pytest.approx((0 + 1 / 4 + 3 / 4) / 3)
    assert result["pass_at_4"] == pytest.approx(2 / 3)
    assert result["num_samples"] == 4
    rewards = [1.0 if i < num_right[s.prompt] else 1 / 3 for s in samples for i in range(4)]
    assert result["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))


def test_correct_is_the_first_reward_component_not_the_weighted_total(tokenizer):
    samples = copy_samples("123", "456")
    # "12" scores exact 0, char 2/3: a total of 4/3 >= 1, but the first component (exact) says wrong
    ev, _ = evaluator(tokenizer, ["rollout.rewards=exact:1.0,char:2.0"], samples,
                      lambda p, i: p[:-1] if p == "123=" else "45")
    result = ev.run()
    assert result["pass_at_1"] == pytest.approx(0.5)
    assert result["reward_mean"] == pytest.approx((3.0 + 4 / 3) / 2)
    assert result["reward_exact_mean"] == pytest.approx(0.5)
    assert result["reward_char_mean"] == pytest.approx((1 + 2 / 3) / 2)


def test_each_source_is_judged_by_its_own_first_reward_and_reported_apart(tokenizer):
    # rollout.source_rewards: "x" rows by exact (then char), the others by char; pass@1 per source as verl reports
    # AIME and MATH500 apart
    samples = [Sample("123=", "123", source="x"), Sample("456=", "456", source="x"), Sample("789=", "789", "y")]
    answers = {"123=": "123", "456=": "45", "789=": "789"}
    rows = Path(__file__).parents[2] / "data" / "math" / "train.jsonl"  # the config needs files; `samples` is the set
    ev, _ = evaluator(tokenizer, ['rollout.source_rewards={"x": "exact:1.0,char:2.0", "*": "char"}',
                                  f"data.train_files={rows}", f"data.val_files={rows}"], samples,
                      lambda p, i: answers[p])
    result = ev.run()
    # "45" scores exact 0 and char 2/3: a total of 4/3, wrong by x's first reward
    assert result["sources"]["x"]["pass_at_1"] == pytest.approx(0.5) and result["sources"]["x"]["num_prompts"] == 2
    assert result["sources"]["y"]["pass_at_1"] == 1.0
    assert result["pass_at_1"] == pytest.approx(2 / 3)
    assert result["reward_exact_mean"] == pytest.approx(0.5)  # over x's answers alone


def test_budgets_are_cut_to_the_context_one_call_per_budget(tokenizer):
    samples = [Sample("1=", "1"), Sample("12345=", "12345"), Sample("2=", "2")]
    ev, fake = evaluator(tokenizer, ["engine.max_model_len=8", "eval.max_tokens=5"], samples,
                         lambda p, i: p[:-1], num_engines=1)
    result = ev.run()
    calls = {s["max_tokens"]: [tokenizer.decode(p) for p in prompts] for _, prompts, s in fake.calls}
    assert calls == {5: ["1=", "2="], 2: ["12345="]}  # 8 - 6 prompt tokens leave 2
    assert result["pass_at_1"] == pytest.approx(2 / 3)  # the long prompt's answer was cut before it was complete
    assert result["truncated_fraction"] == pytest.approx(1 / 3)


def test_a_failing_reward_names_the_sample(tokenizer):
    ev, _ = evaluator(tokenizer, ["rollout.reward_fn=math:sqrt"], copy_samples("123"), lambda p, i: "1")
    with pytest.raises(RewardError, match="evaluation.*'123='"):
        ev.run()


def test_toy_task_eval_set_is_fixed_and_max_prompts_takes_the_first(tokenizer):
    off = load_config(None, [])
    assert make_evaluator(off, [object()], tokenizer, None, None) is None
    cfg = load_config(None, ["eval.every_steps=10"])
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    a = make_evaluator(cfg, [object()], tokenizer, task.reward, task)
    b = make_evaluator(cfg, [object()], tokenizer, task.reward, make_task("copy", length=3))
    assert len(a.prompts) == TOY_PROMPTS and a.prompts == b.prompts
    few = make_evaluator(load_config(None, ["eval.at_end=true", "eval.max_prompts=5"]), [object()], tokenizer,
                         task.reward, task)
    assert few.prompts == a.prompts[:5]


def test_val_files_are_the_eval_set(tokenizer, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(10)))
    cfg = load_config(None, [f"data.val_files={val}", "eval.every_steps=5", "eval.max_prompts=3"])
    ev = make_evaluator(cfg, [object()], tokenizer, make_reward(cfg, make_task("copy", length=3)), None)
    assert [p.sample for p in ev.prompts] == [Sample("0+1=", "1"), Sample("1+1=", "2"), Sample("2+1=", "3")]


@pytest.mark.parametrize("overrides, key", [
    pytest.param(["eval.num_samples=4"], "eval.num_samples", id="greedy_pass_at_k"),
    pytest.param(["eval.num_samples=0", "eval.temperature=1"], "eval.num_samples", id="no_samples"),
    pytest.param(["eval.every_steps=-1"], "eval.every_steps", id="negative_every_steps"),
    pytest.param(["eval.temperature=-0.5"], "eval.temperature", id="negative_temperature"),
    pytest.param(["eval.max_prompts=-1"], "eval.max_prompts", id="negative_max_prompts"),
    pytest.param(["eval.max_tokens=128"], "eval.max_tokens", id="response_longer_than_context"),
])
def test_bad_eval_keys_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert key in message and "\n" not in message
    if "greedy" in message:
        assert "eval.temperature > 0" in message


def test_eval_of_a_run_on_data_files_needs_val_files(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    with pytest.raises(ConfigError, match="data.val_files"):
        load_config(None, [f"data.train_files={train}", "eval.at_end=true"])
    load_config(None, [f"data.train_files={train}"])  # evaluation off: no val files needed
    assert load_config(None, ["eval.num_samples=4", "eval.temperature=1.0"]).eval.num_samples == 4
