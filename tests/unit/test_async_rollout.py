"""algo.mode=async: rollout passes run back to back in a thread (rollout/overlap.py ContinuousRollout), each step takes
rollout.num_prompts complete groups from the pool, and its weight update lands between two passes.

The real controller, Passes, rollout pool and prompt stream; the engine is faked at its actor boundary
(run_pass: tests/unit/test_one_step_off_resume.py's, deterministic in each segment's seed) and takes a few
milliseconds a pass, so passes run while steps train. What is checked does not depend on that timing:
- the order: a step's sync waits for the pass in flight (no pass runs between pause and resume);
- answers go on across an update, their tokens tagged with each pass's version; none trained past the lag cap;
- a run killed after a checkpoint and resumed from it trains no group twice and loses none (counted by group:
  every group drawn from the prompt stream is trained once or still in the pool at the end).
Config refusals are at the end. The real stack: tests/e2e/test_algorithms.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from colocate.config import load_config
from colocate.engine.requests import RequestResult
from colocate.errors import ConfigError
from colocate.rollout.overlap import ContinuousRollout
from colocate.job.preflight import ASYNC_PLAN, default_plan
from tests.unit.test_one_step_off_resume import FakeGeneratingEngine, controller_with_rollouts

NUM_STEPS, STOP_AFTER = 6, 2
ASYNC = ["algo.mode=async", "rollout.num_prompts=4", "rollout.num_samples=2", "rollout.partial_tokens=2",
         "rollout.max_tokens=4", "rollout.max_lag=2", "rollout.oversample=1.5"]


class SlowEngine(FakeGeneratingEngine):
    """A pass takes 3 ms, and records whether a weight update was running meanwhile."""

    def __init__(self, *args, updating: threading.Event, overlaps: list):
        super().__init__(*args)
        self.updating, self.overlaps = updating, overlaps

    def do_run_pass(self, requests, sampling, num_groups_wanted, version=0):
        self.overlaps.append(self.updating.is_set())
        time.sleep(0.003)
        self.overlaps.append(self.updating.is_set())
        return super().do_run_pass(requests, sampling, num_groups_wanted)


def async_controller(monkeypatch, tmp_path, state=None):
    controller = controller_with_rollouts(monkeypatch, tmp_path, ASYNC, state=state)
    updating, overlaps = threading.Event(), []
    controller.rt.engines[0] = SlowEngine("engine 0", [], {}, updating=updating, overlaps=overlaps)
    controller.overlaps = overlaps
    original_sync = controller.sync

    def sync():
        updating.set()
        time.sleep(0.005)  # long enough for a pass that wrongly overlaps it to be seen
        try:
            return original_sync()
        finally:
            updating.clear()

    controller.sync = sync
    taken_ids = controller.taken_ids = []
    pool = controller.passes.pool
    original_take = pool.take

    def take(num_groups=None):
        groups = original_take(num_groups)
        taken_ids.append([g.group_id for g in groups])
        return groups

    pool.take = take
    return controller


def test_async_updates_between_passes_and_answers_go_on_under_the_new_weights(monkeypatch, tmp_path):
    controller = async_controller(monkeypatch, tmp_path / "run")
    try:
        controller.run_steps(NUM_STEPS)
    finally:
        controller.close()
    assert controller.overlaps and not any(controller.overlaps)  # no pass ever ran while the weights changed
    events = list(controller.events)
    step = events[:events.index("sync") + 1]
    assert step == ["rollout", "score", "train", "trainer.release_grads", "rollout.pause", "sync"]
    assert events.count("rollout.resume") == NUM_STEPS - 1  # not after the last step: the passes stop there
    assert all(len(ids) == 4 for ids in controller.taken_ids)  # exactly rollout.num_prompts groups a step
    for step, groups in enumerate(controller.trained):
        for _, answers in groups:
            for _, versions in answers:
                assert versions == sorted(versions) and step - versions[0] <= 2  # the lag cap (max_lag=2)
    record = controller.history[-1]
    assert record["rollout"]["max_lag"] <= 2 and sum(record["rollout"]["token_lags"].values()) == \
        record["num_response_tokens"]


class GatedEngine(FakeGeneratingEngine):
    """Runs a pass only when the test lets one through; every answer takes its whole segment, so an answer of
    rollout.max_tokens=4 in segments of 2 needs exactly two passes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate, self.num_passes = threading.Semaphore(0), 0

    def do_run_pass(self, requests, sampling, num_groups_wanted, version=0):
        self.gate.acquire()
        results = [RequestResult(r.request_id, [7] * r.max_tokens, [-0.5] * r.max_tokens,
                                 "length" if r.final else None, 0) for r in requests]
        self.num_passes += 1
        return {"results": results, "timeline": [(0.0, len(requests))], "seconds": 0.0}


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_an_update_between_two_passes_continues_the_answers_under_the_new_version(monkeypatch, tmp_path):
    """Pass 1 under version 0, a pause (the weight update), resume with version 1, pass 2: every answer trained
    holds two tokens of each version, and the staleness counts them so."""
    controller = controller_with_rollouts(monkeypatch, tmp_path / "run", ASYNC)
    engine = controller.rt.engines[0] = GatedEngine("engine 0", [], {})
    rollouts = controller.passes
    passes = ContinuousRollout(rollouts, version=0)  # planned pass 1 and waits at the gate
    try:
        pausing = threading.Thread(target=passes.pause)  # the update asks for a pause while pass 1 runs
        pausing.start()
        wait_for(lambda: passes._paused)
        engine.gate.release()
        pausing.join(10)
        assert not pausing.is_alive() and engine.num_passes == 1
        answers = [a for g in rollouts.pool.groups for a in g.answers]
        assert len(answers) == 6 * 2 and all(a.versions == [0, 0] and not a.done for a in answers)
        passes.resume(version=1)
        engine.gate.release()
        groups, stats = passes.take(trained_version=1)
        assert len(groups) == 4 and engine.num_passes == 2
        assert all(a.versions == [0, 0, 1, 1] and a.done for g in groups for a in g.completions)
        assert stats["num_passes"] == 2 and stats["token_lags"] == {"0": 16, "1": 16} and stats["max_lag"] == 1
    finally:
        passes.close()
        engine.gate.release()


def test_async_resumed_from_a_checkpoint_loses_no_group_and_trains_none_twice(monkeypatch, tmp_path):
    first = async_controller(monkeypatch, tmp_path / "first")
    saved = {}
    # the checkpoint after step STOP_AFTER's sync (the passes paused), then the job is killed: whatever the
    # passes generate after it is lost with the process
    first.checkpointer.due = lambda num_done, num_steps: num_done == STOP_AFTER + 1
    first.save_checkpoint = lambda step: saved.update(json.loads(json.dumps(first.checkpoint_state(step))))
    for step in range(STOP_AFTER + 1):
        first.step(step, num_steps=NUM_STEPS)
    first.close()
    assert saved["step"] == STOP_AFTER
    resumed = async_controller(monkeypatch, tmp_path / "resumed", state=saved)
    try:
        resumed.run_steps(NUM_STEPS, first=STOP_AFTER + 1)
    finally:
        resumed.close()

    trained = [i for ids in first.taken_ids[:STOP_AFTER + 1] + resumed.taken_ids for i in ids]
    assert len(trained) == 4 * NUM_STEPS and len(set(trained)) == len(trained)  # none twice
    in_pool = {g.group_id for g in resumed.passes.pool.groups}
    drawn = set(range(resumed.passes.pool._next_group_id))
    assert drawn == set(trained) | in_pool and not set(trained) & in_pool  # none lost


def test_a_failed_pass_is_raised_on_the_main_thread(monkeypatch, tmp_path):
    controller = async_controller(monkeypatch, tmp_path / "run")

    def fail(*args):
        raise RuntimeError("engine 0 lost")

    controller.rt.engines[0].do_run_pass = fail
    with pytest.raises(RuntimeError, match="engine 0 lost"):
        controller.run_steps(NUM_STEPS)
    controller.close()


@pytest.mark.parametrize("overrides, needles", [
    (["rollout.partial_tokens=0"], ["rollout.partial_tokens=0 is invalid", "between two passes", "> 0"]),
    (["rollout.max_lag=0"], ["rollout.max_lag=0 is invalid", "algo.mode=async", ">= 1"]),
    (["engine.sleep_level=2"], ["engine.sleep_level='2' is invalid", "never sleeps"]),
    (["trainer.offload=true"], ["trainer.offload='true' is invalid", "auto or false"]),
], ids=["unbounded_passes", "no_lag_allowed", "sleeping_engine", "offloaded_trainer"])
def test_bad_async_settings_are_one_line(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algo.mode=async", "rollout.partial_tokens=3", "rollout.max_tokens=3",
                           "rollout.max_lag=2", *overrides])
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_async_keeps_both_sides_resident():
    cfg = load_config(None, ["algo.mode=async", "rollout.partial_tokens=1", "rollout.max_tokens=3",
                             "rollout.max_lag=2"])
    assert default_plan(cfg) == ASYNC_PLAN and ASYNC_PLAN.engine_sleep_level == 0 and not ASYNC_PLAN.trainer_offload
