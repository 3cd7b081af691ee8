"""The multi-turn demo as a user launches it (`configs/multiturn.yaml`): the tiny model, each answer an episode of
two turns with the copy_turns environment, which shows new digits between the turns, held by two environment
workers (Ray actors). The evaluation at the end plays whole episodes too. The reward rises over the
steps, every episode's turns are in the metrics, and the environment's tokens are in the answers but never
trained."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.e2e.conftest import launch

pytestmark = pytest.mark.e2e

NUM_STEPS = 16


def test_the_multiturn_demo_learns_and_trains_only_the_models_tokens(tmp_path):
    # the environments in two Ray actors (rollout.env_workers); tests/e2e/test_calculator.py runs them in-process
    result = launch(tmp_path, f"algo.num_steps={NUM_STEPS}", "logging.progress=false", "checkpoint.at_end=false",
                    "rollout.env_workers=2", "eval.at_end=true", "eval.max_prompts=8",
                    # one slot (a trainer rank, a TP=1 engine): the episodes are the driver's and the env workers'
                    "placement.num_slots=1", "engine.tp=1",
                    config=("configs/default.yaml", "configs/multiturn.yaml"), small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(NUM_STEPS))
    for r in steps:
        rollout = r["rollout"]
        # 16 prompts x 8 episodes of 2 turns, each observation "ddd=" (4 tokens) between them
        assert rollout["turns_per_episode"] == 2.0 and rollout["most_turns"] == 2
        assert rollout["num_observation_tokens"] == 16 * 8 * 4 and rollout["num_env_dropped"] == 0
        assert r["num_trained_tokens"] == r["num_response_tokens"] - rollout["num_observation_tokens"]
        assert sum(rollout["token_lags"].values()) == r["num_trained_tokens"]  # staleness counts trained tokens
    # the evaluation after the last step played whole episodes with the environment (greedy, in-process)
    evaluation = steps[-1]["eval"]
    assert evaluation["turns_per_episode"] == 2.0 and evaluation["num_prompts"] == 8
    assert 0.0 <= evaluation["pass_at_1"] <= 1.0 and 0.0 <= evaluation["reward_mean"] <= 2.0
    # measured 0.059 -> 0.127 (mean of the first and of the last 4 of 16 steps; 2-core AMD EPYC)
    first = statistics.fmean(r["reward_mean"] for r in steps[:4])
    last = statistics.fmean(r["reward_mean"] for r in steps[-4:])
    assert last > first + 0.02, (first, last, [round(r["reward_mean"], 3) for r in steps])
