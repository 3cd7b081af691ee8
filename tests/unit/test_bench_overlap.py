"""`bench async`'s arithmetic on hand-made spans: each side's busy time is the union of its spans within a step's
wall time (its main thread's phases), idle is the rest, and the schedule model hides the shorter of rollout and
train."""

from __future__ import annotations

import pytest

from colocate.bench.overlap import _row, _schedule_model, _union


def test_union_counts_overlapping_spans_once():
    assert _union([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)
    assert _union([]) == 0.0


def test_a_one_step_off_step_the_engine_and_trainer_busy_at_once():
    # step 1: take 0..0.1, train 0.2..2.2 while the next rollout runs 0.15..3.15, wait 2.2..3.15, sync 3.15..3.5
    spans = [("rollout", 1, 0.0, 0.1), ("score", 1, 0.1, 0.15), ("rollout.ahead", 1, 0.15, 3.15),
             ("train", 1, 0.2, 2.2), ("rollout_wait", 1, 2.2, 3.15), ("sync", 1, 3.15, 3.5)]
    record = {"num_response_tokens": 700, "times": {"rollout": 0.1, "train": 2.0, "sync": 0.35},
              "rollout": {"token_lags": {"1": 700}, "max_lag": 1, "stale_token_fraction": 1.0, "seconds": 3.0,
                          "mean_running": 40.0,
                          "num_tokens_generated": 700, "num_lag_restarts": 0}}
    row = _row([record], spans, steps=range(1, 2))
    assert row["step_s"] == pytest.approx(3.5) and row["trained_tokens_per_s"] == pytest.approx(200)
    assert row["engine_busy_s"] == pytest.approx(3.1)  # the take (0.1) and the generation (3.0)
    assert row["trainer_idle_s"] == pytest.approx(1.5) and row["engine_idle_s"] == pytest.approx(0.4)
    assert row["token_lags"] == {"1": 700} and row["max_lag"] == 1


def test_the_schedule_model_hides_the_shorter_phase():
    model = _schedule_model({"phase_s": {"rollout": 3.0, "train": 2.0, "sync": 0.5, "score": 0.5}})
    assert (model["sync_step_s"], model["one_step_off_step_s"]) == (6.0, 4.0) and model["speedup"] == 1.5


def test_an_async_step_counts_its_passes_as_engine_busy():
    # step 1: take 0..0.05 (passes already ran), train 0.1..2.1, passes 0.1..0.9 and 0.9..1.7 meanwhile, then a
    # pass 1.7..2.3 the update waits for (rollout_wait 2.1..2.3), sync 2.3..2.5
    spans = [("rollout", 1, 0.0, 0.05), ("score", 1, 0.05, 0.1), ("train", 1, 0.1, 2.1),
             ("rollout.pass", 1, 0.1, 0.9), ("rollout.pass", 1, 0.9, 1.7), ("rollout.pass", 1, 1.7, 2.3),
             ("rollout_wait", 1, 2.1, 2.3), ("sync", 1, 2.3, 2.5)]
    record = {"num_response_tokens": 500, "times": {"rollout": 0.05, "train": 2.0, "rollout_wait": 0.2, "sync": 0.2},
              "rollout": {"token_lags": {"0": 100, "1": 400}, "max_lag": 1, "stale_token_fraction": 0.8,
                          "seconds": 2.2, "mean_running": 30.0,
                          "num_tokens_generated": 600, "num_lag_restarts": 1}}
    row = _row([record], spans, steps=range(1, 2))
    assert row["step_s"] == pytest.approx(2.5) and row["trained_tokens_per_s"] == pytest.approx(200)
    assert row["engine_busy_s"] == pytest.approx(0.05 + 2.2)  # the take, and the three passes end to end
    assert row["generated_per_trained"] == pytest.approx(1.2) and row["num_lag_restarts"] == 1
    assert row["trainer_idle_s"] == pytest.approx(0.5) and row["engine_idle_s"] == pytest.approx(0.25)


def test_a_streamed_pass_across_steps_is_busy_within_each_step_and_the_steps_wall_is_the_main_threads():
    # one engine pass 0.0..5.0 (streamed: it ran through steps 1 and 2, and step 2 collected it); step 1 runs
    # 1.0..3.0, step 2 3.0..4.5: each is busy its whole wall on the engine side, and no step is 5 s long
    spans = [("rollout", 1, 1.0, 1.1), ("train", 1, 1.1, 2.8), ("sync", 1, 2.8, 3.0),
             ("rollout", 2, 3.0, 3.2), ("train", 2, 3.2, 4.3), ("sync", 2, 4.3, 4.5), ("rollout.pass", 2, 0.0, 5.0)]
    record = {"num_response_tokens": 300, "times": {"rollout": 0.15, "train": 1.4, "sync": 0.2},
              "rollout": {"token_lags": {"1": 300}, "max_lag": 1, "stale_token_fraction": 1.0, "seconds": 1.75,
                          "mean_running": 90.0,
                          "num_tokens_generated": 300, "num_lag_restarts": 0}}
    row = _row([record, record], spans, steps=range(1, 3))
    assert row["step_s"] == pytest.approx((2.0 + 1.5) / 2) and row["engine_idle_s"] == pytest.approx(0.0)
    assert row["trainer_busy_s"] == pytest.approx((1.7 + 1.1) / 2) and row["mean_running"] == 90.0
