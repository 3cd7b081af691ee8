"""The algorithm presets through `colocate launch`, as a user composes them: the default job with DAPO's preset
(configs/algos/dapo.yaml: clip-higher, dynamic sampling, token-level loss, 16 mini-batches) learns, and every
step trains exactly rollout.num_prompts groups whose rewards differ, refilled through the rollout pool, with what
was filtered in the metrics. (The counting of the groups trained, group by group, is tests/e2e/test_rollout.py's,
on a shared engine.) And algo.mode=one_step_off learns on the same job, every token it trains one policy version
old and none older; and algo.mode=async, within its lag cap. And PPO with a critic (configs/algos/ppo.yaml)
learns as GRPO does, its critic's loss falls, and a trainer killed mid-run is restarted from its checkpoint and
continues exactly: policy and critic, weights and AdamW moments, bit for bit."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

import torch

from colocate.job.rollout_dump import read_rollouts
from tests.e2e.conftest import checkpoint_tensors, launch

pytestmark = pytest.mark.e2e

NUM_STEPS = 12
# one slot (a trainer rank, a TP=1 engine): what these check is the algorithms' learning and bookkeeping, which
# no layout changes; the default layout's TP=2 sync is every other job's
ONE_SLOT = ("placement.num_slots=1", "engine.tp=1")


def test_the_dapo_preset_on_the_default_job_learns(tmp_path):
    # the default job as `make run` runs it (16 prompts x 8 answers of 3 tokens), shortened
    result = launch(tmp_path, f"algo.num_steps={NUM_STEPS}", "logging.progress=false", "checkpoint.at_end=false",
                    *ONE_SLOT, config=("configs/default.yaml", "configs/algos/dapo.yaml"), small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved["algo"]["dynamic_sampling"] and saved["algo"]["clip_eps_high"] == 0.28  # the preset merged
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(NUM_STEPS))
    for r in steps:
        sampling = r["rollout"]["dynamic_sampling"]
        # exactly 16 groups trained, each of 8 answers; what was filtered is counted and reported
        assert sampling["num_groups_kept"] == 16 == r["rollout"]["num_groups"] and sampling["num_groups_short"] == 0
        assert r["num_trained_sequences"] == 16 * 8
        assert sampling["num_groups_sampled"] == 16 + sampling["num_groups_uniform"] + sampling["num_groups_surplus"]
        assert sampling["filtered_fraction"] == pytest.approx(sampling["num_groups_uniform"] /
                                                              sampling["num_groups_sampled"])
        assert r["lr"] == 1e-3 and r["clip_fraction"] >= 0
        assert len(r["updates"]) == 16  # the preset's mini-batches: 16 optimizer steps of 8 answers
    assert any(r["rollout"]["dynamic_sampling"]["num_refills"] > 0 for r in steps)  # the refill was exercised
    first = statistics.fmean(r["reward_mean"] for r in steps[:4])
    last = statistics.fmean(r["reward_mean"] for r in steps[-4:])
    assert last > first + 0.02 and last > 1.5 * first, (first, last, [round(r["reward_mean"], 3) for r in steps])


def test_the_ppo_preset_learns_and_a_killed_run_continues_exactly(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    job = (f"algo.num_steps={NUM_STEPS}", "logging.progress=false", "checkpoint.every_steps=4", *ONE_SLOT)
    config = ("configs/default.yaml", "configs/algos/ppo.yaml")
    result = launch(whole, *job, "logging.rollouts=1", config=config, small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    # the dump: each answer's advantages, returns and the critic's values as trained, and the recomputed proximal
    # log-probs as the trainer's (not scored a second time)
    dumped = read_rollouts(whole / "out" / "rollouts.jsonl")
    assert len(dumped) == NUM_STEPS * 8 and all(len(d["token_advantages"]) == len(d["returns"]) == len(d["values"])
                                                == len(d["response_ids"]) == len(d["trainer_logprobs"])
                                                for d in dumped)
    assert all(v == 0.0 for d in dumped if d["step"] == 0 for v in d["values"])  # the head starts at 0
    assert any(v != 0.0 for d in dumped if d["step"] == NUM_STEPS - 1 for v in d["values"])
    steps = [json.loads(line) for line in (whole / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "event" not in r]
    assert [r["step"] for r in steps] == list(range(NUM_STEPS))
    for r in steps:
        assert len(r["updates"]) == 4 and all(u["value_loss"] > 0 for u in r["updates"])  # 2 mini-batches x 2
        assert r["critic"]["lr"] == 1e-3 and r["num_trained_sequences"] == 16 * 8
    # the critic: its head starts at 0, so step 0's loss before the update is exactly that of a zero critic; then
    # its loss on each step's returns, before that step's update, falls below it (measured 1.0 -> 0.51 over these
    # 12 steps, 2-core AMD EPYC)
    fit = [r["critic"]["value_loss_before"] / r["critic"]["value_loss_of_zero"] for r in steps]
    assert fit[0] == pytest.approx(1.0, abs=1e-9)
    assert statistics.fmean(fit[-4:]) < 0.85 * statistics.fmean(fit[:4]), [round(f, 3) for f in fit]
    # the reward rises as GRPO's does on this job (test_the_dapo_preset...; GRPO alone: 0.028 -> 0.078 in these
    # 12 steps; this preset: 0.028 -> 0.176, with 4 optimizer steps a step)
    first = statistics.fmean(r["reward_mean"] for r in steps[:4])
    last = statistics.fmean(r["reward_mean"] for r in steps[-4:])
    assert last > first + 0.02 and last > 1.5 * first, (first, last, [round(r["reward_mean"], 3) for r in steps])

    # the same job with trainer rank 0 killed in step 6's training: restarted whole from step 3's checkpoint
    result = launch(killed, *job, "fault.inject=SIGKILL:trainer0:train:6", "fault.max_restarts=1", config=config,
                    small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (killed / "out" / "metrics.jsonl").read_text().splitlines()]
    restarts = [r for r in records if r.get("event") == "restart"]
    assert [r["from"].rsplit("/", 1)[1] for r in restarts] == ["step_00000003"]
    again = {r["step"]: r for r in records if "event" not in r}
    for r in steps:
        for key in ("reward_mean", "loss", "critic", "updates"):
            assert again[r["step"]][key] == r[key], (r["step"], key)
    last = f"step_{NUM_STEPS - 1:08d}"
    for name in ("trainer", "critic"):
        a, b = (checkpoint_tensors(run / "out" / "checkpoints" / last, name) for run in (whole, killed))
        assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a), name
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_one_step_off_on_the_default_job_learns_within_its_lag(tmp_path):
    """Step k trains what the engines generated with the weights after step k - 2 while step k - 1 trained: the
    per-token lag histogram says so every step, the lag cap (rollout.max_lag=1) holds, the trainer's wait for the
    engines is timed, and the reward rises."""
    result = launch(tmp_path, f"algo.num_steps={NUM_STEPS}", "algo.mode=one_step_off", "logging.progress=false",
                    "checkpoint.at_end=false", *ONE_SLOT, config=("configs/default.yaml",), small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(NUM_STEPS))
    tokens = [sum(r["rollout"]["token_lags"].values()) for r in steps]
    assert steps[0]["rollout"]["token_lags"] == {"0": tokens[0]}  # the first step generates its own
    for r, num_tokens in zip(steps[1:], tokens[1:]):
        assert r["rollout"]["token_lags"] == {"1": num_tokens} and r["rollout"]["max_lag"] == 1
        assert r["rollout"]["stale_token_fraction"] == 1.0 and num_tokens == r["num_response_tokens"]
    assert all("rollout_wait" in r["times"] for r in steps[:-1]) and "rollout_wait" not in steps[-1]["times"]
    startup = next(r for r in records if r.get("event") == "startup")
    assert startup["switch"]["engine_sleep_level"] == 0 and not startup["switch"]["trainer_offload"]
    # a step of lag slows the rise: measured 0.028 -> 0.043 over these 12 steps (2-core AMD EPYC)
    first = statistics.fmean(r["reward_mean"] for r in steps[:4])
    last = statistics.fmean(r["reward_mean"] for r in steps[-4:])
    assert last > first + 0.01 and last > 1.3 * first, (first, last, [round(r["reward_mean"], 3) for r in steps])


def test_async_on_the_default_job_learns_within_its_lag(tmp_path):
    """The engines generate without pause (passes of 2 tokens an answer), each step trains the first 16 complete
    groups, and its weight update waits only for the pass in flight: every token trained is within the lag cap
    (rollout.max_lag=2), the histogram covers every token trained, and the reward rises."""
    result = launch(tmp_path, f"algo.num_steps={NUM_STEPS}", "algo.mode=async", "rollout.partial_tokens=2",
                    "rollout.max_lag=2", "logging.progress=false", "checkpoint.at_end=false", *ONE_SLOT,
                    config=("configs/default.yaml",), small=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(NUM_STEPS))
    for r in steps:
        lags = r["rollout"]["token_lags"]
        assert sum(lags.values()) == r["num_response_tokens"] and r["rollout"]["max_lag"] <= 2
        assert max(int(lag) for lag in lags) == r["rollout"]["max_lag"] and r["rollout"]["num_groups"] == 16
    assert steps[0]["rollout"]["token_lags"] == {"0": steps[0]["num_response_tokens"]}  # nothing before it
    assert any(r["rollout"]["stale_token_fraction"] > 0 for r in steps[1:])  # generated during earlier steps
    assert all("rollout_wait" in r["times"] for r in steps)  # each update waited for the pass in flight
    startup = next(r for r in records if r.get("event") == "startup")
    assert startup["switch"]["engine_sleep_level"] == 0 and not startup["switch"]["trainer_offload"]
    # measured 0.023 -> 0.040 over these 12 steps (2-core AMD EPYC, a suite running beside it)
    first = statistics.fmean(r["reward_mean"] for r in steps[:4])
    last = statistics.fmean(r["reward_mean"] for r in steps[-4:])
    assert last > first + 0.01 and last > 1.3 * first, (first, last, [round(r["reward_mean"], 3) for r in steps])
