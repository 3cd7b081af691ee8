"""Rewards from a model as a user launches them: the policy's engine (TP=2) and a reward model's engine on its
first slot, the reward model asleep while the trainer trains (engine.sleep_level=1 makes the switch move on
this small job). A sequence classifier (the embedded tiny-rm) beside a rule reward, for a MoE policy (tiny-moe),
and a generative judge (the tiny causal preset, its verdict's digit read as the score)."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.conftest import launch

pytestmark = pytest.mark.e2e

NUM_PROMPTS, NUM_SAMPLES = 4, 4  # launch()'s small job


@pytest.mark.parametrize("rewards, extra", [
    # the policy here is the MoE preset at TP=2 (each expert's intermediate dimension split over the workers), its
    # sync compared with the trainer in full every step: the MoE e2e without expert parallelism (tests/e2e/
    # test_moe.py has the expert-parallel one), sharing this job's engine start
    pytest.param("char:1,model:tiny-rm:0.5", ("model.preset=tiny-moe", "sync.verify=full"), id="classifier"),
    # the judge beside a one-slot policy (a trainer rank, a TP=1 engine): the policy's layout is the classifier's
    pytest.param("judge:tiny", (r"reward_model.verdict_pattern=\d", "reward_model.judge_max_tokens=4",
                                "placement.num_slots=1", "engine.tp=1"), id="judge"),
])
def test_a_served_reward_model_scores_every_answer_and_sleeps_while_training(tmp_path, rewards, extra):
    result = launch(tmp_path, f"rollout.rewards={rewards}", *extra, "engine.sleep_level=1", "algo.num_steps=2",
                    "logging.progress=false", "checkpoint.at_end=false", "eval.at_end=true", "eval.max_prompts=4")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    startup = next(r for r in records if r.get("event") == "startup")
    kind = rewards.split(",")[-1].split(":")[0]
    served = startup["reward_model"]
    assert served["kind"] == kind and served["slots"] == [0] and served["devices"] == ["cpu-slot0"]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1]
    if "model.preset=tiny-moe" in extra:  # verify=full passed every step; the experts took the resharded path
        assert all(r["sync_mode"] == "sliced" for r in steps)
    for r in steps:
        stats = r["reward_model"]
        assert stats["kind"] == kind and stats["num_scored"] == NUM_PROMPTS * NUM_SAMPLES
        assert stats["sleep_freed_bytes"] > 0  # it slept (its KV cache freed) while the trainer trained
        assert r["memory"]["reward_model_rss_bytes"] > 0
        assert math.isfinite(r[f"reward_{kind}_mean"])
        if r["step"] == 1:  # the evaluation after it (greedy: 4 answers) is counted apart from the step's 16
            assert r["eval"]["reward_model"]["num_scored"] == 4 and f"reward_{kind}_mean" in r["eval"]
        if kind == "model":  # the weighted sum of the rule's and the classifier's means
            assert r["reward_mean"] == pytest.approx(r["reward_char_mean"] + 0.5 * r["reward_model_mean"])
        else:  # a digit, or the unparsed reward (0) for a verdict without one
            assert 0 <= r["reward_judge_mean"] <= 9 and 0 <= stats["num_unparsed"] <= stats["num_scored"]
