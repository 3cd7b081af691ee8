"""algo.mode=async with rollout.update_in_pass: the sync does not wait for the pass in flight; the engines park it
between two engine steps (engine/pass_gate.py), the weights change, and it goes on under the new version.

The real controller, InPassRollout, ContinuousRollout, Passes, pool and PassGate; the engine is faked at its actor
boundary (run_pass, pause_pass, resume_pass) and steps through a real PassGate one token a step, a few
milliseconds each, so that an update lands inside passes. What is checked does not depend on where it lands:
- no engine step runs while the weights change (the gate parks the pass);
- each token is tagged with the version of the weights that sampled it; a segment may hold two;
- the passes go on right after the sync, before the step's checkpoint and metrics;
- a checkpoint taken while a pass is in flight resumes with no group lost and none trained twice.
The real engine: tests/e2e/test_rollout.py (tokens after the update are the new weights')."""

from __future__ import annotations

import json
import threading
import time

import pytest

from colocate.config import load_config
from colocate.engine.pass_gate import PassGate
from colocate.engine.requests import RequestResult
from colocate.errors import ConfigError
from colocate.rollout.modes import InPassRollout
from tests.unit.test_async_rollout import NUM_STEPS, STOP_AFTER
from tests.unit.test_one_step_off_resume import FakeGeneratingEngine, controller_with_rollouts

IN_PASS = ["algo.mode=async", "rollout.num_prompts=4", "rollout.num_samples=2", "rollout.partial_tokens=4",
           "rollout.max_tokens=8", "rollout.max_lag=2", "rollout.oversample=1.5", "rollout.update_in_pass=keep"]
STEP_S = 0.005  # one fake engine step


class SteppedEngine(FakeGeneratingEngine):
    """One token per engine step for every request, each step inside the gate's work(); a request runs its whole
    segment (final ones complete their answer). Records whether a weight update was running during any step."""

    def __init__(self, *args, updating: threading.Event):
        super().__init__(*args)
        self.gate, self.updating, self.overlaps = PassGate(), updating, []

    def do_run_pass(self, requests, sampling, num_groups_wanted, version=0):
        results = [RequestResult(r.request_id, [], [], None, 0) for r in requests]
        with self.gate.running(version):
            for _ in range(max(r.max_tokens for r in requests)):
                with self.gate.work():
                    if self.gate.ending:
                        break
                    self.overlaps.append(self.updating.is_set())
                    time.sleep(STEP_S)
                    self.gate.steps += 1
                    for r, result in zip(requests, results):
                        if len(result.token_ids) < r.max_tokens:
                            result.token_ids.append(7)
                            result.logprobs.append(-0.5)
                            result.versions.append(self.gate.version)
                    self.overlaps.append(self.updating.is_set())
        for r, result in zip(requests, results):
            result.finish_reason = "length" if len(result.token_ids) == r.max_tokens and r.final else None
        return {"results": results, "timeline": [(0.0, len(requests))], "seconds": 0.0,
                "parked_s": self.gate.parked_s}

    def do_pause_pass(self):
        return self.gate.pause()

    def do_resume_pass(self, version, kv, end=False):
        self.gate.resume(version, end=end)


def in_pass_controller(monkeypatch, tmp_path, state=None, extra=()):
    controller = controller_with_rollouts(monkeypatch, tmp_path, [*IN_PASS, *extra], state=state)
    updating = threading.Event()
    engine = controller.rt.engines[0] = SteppedEngine("engine 0", [], {}, updating=updating)
    controller.engine = engine
    original_sync = controller.sync

    def sync():
        updating.set()
        time.sleep(3 * STEP_S)  # long enough for a step that wrongly overlaps it to be seen
        try:
            return original_sync()
        finally:
            updating.clear()

    controller.sync = sync
    original_train = controller.train

    def train(scored, step):
        # a step trains while the next pass runs (its first engine step done): its update lands inside that pass,
        # whatever the machine's load does to the threads' order
        deadline = time.monotonic() + 10
        while not (engine.gate.in_pass and engine.gate.steps >= 1) and time.monotonic() < deadline:
            time.sleep(0.001)
        return original_train(scored, step)

    controller.train = train
    taken = controller.taken_ids = []
    pool = controller.passes.pool
    original_take = pool.take
    pool.take = lambda num_groups=None: [taken.append(g.group_id) or g for g in original_take(num_groups)]
    return controller


def test_updates_land_inside_passes_and_each_token_has_its_weights_version(monkeypatch, tmp_path):
    controller = in_pass_controller(monkeypatch, tmp_path / "run")
    assert isinstance(controller.rollout, InPassRollout)
    try:
        controller.run_steps(NUM_STEPS)
    finally:
        controller.close()
    engine = controller.engine
    assert engine.overlaps and not any(engine.overlaps)  # no engine step ever ran while the weights changed
    events = list(controller.events)
    first = events[:events.index("sync") + 2]
    assert first[-4:-2] in (["trainer.release_grads", "rollout.park"], ["trainer.release_grads", "rollout.pause"])
    assert first[-2:] == ["sync", "rollout.resume"]  # the passes go on right after the sync
    assert "rollout.park" in events, "no update landed inside a pass"
    split = 0
    for step, groups in enumerate(controller.trained):
        for _, answers in groups:
            for _, versions in answers:
                assert versions == sorted(versions) and step - versions[0] <= 2  # the lag cap (max_lag=2)
                # a change of version inside a segment of 4 tokens: an update landed inside that pass
                split += any(versions[i] != versions[i + 1] for i in range(len(versions) - 1) if (i + 1) % 4)
    assert split, "no answer was split by an update inside its pass"
    assert not engine.gate.in_pass and not engine.gate.held  # the last step ended the pass in flight


def test_resumed_from_a_checkpoint_taken_during_a_pass_loses_no_group_and_trains_none_twice(monkeypatch, tmp_path):
    first = in_pass_controller(monkeypatch, tmp_path / "first")
    saved = {}
    # the checkpoint after step STOP_AFTER's sync, while the pass goes on; then the job is killed
    first.checkpointer.due = lambda num_done, num_steps: num_done == STOP_AFTER + 1
    first.save_checkpoint = lambda step: saved.update(json.loads(json.dumps(first.checkpoint_state(step))))
    for step in range(STOP_AFTER + 1):
        first.step(step, num_steps=NUM_STEPS)
    first.close()
    resumed = in_pass_controller(monkeypatch, tmp_path / "resumed", state=saved)
    try:
        resumed.run_steps(NUM_STEPS, first=STOP_AFTER + 1)
    finally:
        resumed.close()
    trained = first.taken_ids[:4 * (STOP_AFTER + 1)] + resumed.taken_ids
    assert len(trained) == 4 * NUM_STEPS and len(set(trained)) == len(trained)  # none twice
    in_pool = {g.group_id for g in resumed.passes.pool.groups}
    drawn = set(range(resumed.passes.pool._next_group_id))
    assert drawn == set(trained) | in_pool and not set(trained) & in_pool  # none lost


def test_dynamic_sampling_refills_from_the_running_passes(monkeypatch, tmp_path):
    """algo.dynamic_sampling with async: a step short of informative groups takes more complete groups from the
    passes that run on the engines (never a rollout of the main thread's beside them), and trains exactly
    rollout.num_prompts informative groups, each drawn once. Here a group is informative when its prompt's
    characters sum to an odd number (about half of them)."""
    controller = in_pass_controller(monkeypatch, tmp_path / "run", extra=["algo.dynamic_sampling=true",
                                                                        "rollout.max_refill_passes=8"])
    scored_by_wrapper = controller.score

    def score(groups):
        scored = scored_by_wrapper(groups)
        for g in scored:
            g.rewards = [1.0, 0.0] if sum(map(ord, g.group.sample.prompt)) % 2 else [0.0, 0.0]
            g.task_rewards = None
        return scored

    controller.score = score
    monkeypatch.setattr(controller.passes, "collect", lambda *a, **k: pytest.fail("a rollout on the main thread"))
    try:
        records = controller.run_steps(NUM_STEPS)
    finally:
        controller.close()
    assert not any(controller.engine.overlaps)
    refills = [r["rollout"]["dynamic_sampling"]["num_refills"] for r in records]
    assert sum(refills) > 0, "no step needed a refill"
    for r in records:
        sampling = r["rollout"]["dynamic_sampling"]
        assert sampling["num_groups_kept"] == 4 and sampling["num_groups_short"] == 0, sampling
        assert r["rollout"]["max_lag"] <= 2  # the lag cap
    taken = controller.taken_ids
    assert len(taken) == len(set(taken))  # every group drawn once, refills included


@pytest.mark.parametrize("overrides, needles", [
    (["algo.mode=sync"], ["rollout.update_in_pass='keep' is invalid", "algo.mode=async", "never"]),
    (["rollout.update_in_pass=later"], ["rollout.update_in_pass='later' is invalid", "never, keep, recompute"]),
    (["rollout.max_lag=1"], ["rollout.partial_tokens=4 is invalid", "inside each pass", "rollout.max_lag = 1",
                             "rollout.partial_tokens >= 8"]),
    (["rollout.update_in_pass=never", "rollout.stream=true"], ["rollout.stream=True is invalid", "without end",
                                                               "rollout.update_in_pass=keep or recompute"]),
    (["rollout.stream=true", "rollout.partial_tokens=0", "rollout.leftover=drop"],
     ["rollout.leftover='drop' is invalid", "rollout.stream", "valid with it: carry"]),
], ids=["not_async", "unknown_policy", "lag_cap_cannot_hold_the_passes", "stream_without_updates_in_pass",
        "stream_dropping_what_it_decodes"])
def test_bad_in_pass_settings_are_one_line(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*IN_PASS, *overrides])
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_a_pass_takes_the_update_that_landed_between_its_planning_and_its_start_and_no_other():
    """The driver plans a pass under version 3, and its update to 4 reaches the engine before the pass does: the
    pass samples with 4. A later pass, or one after a rollout that ended (another run on the same engines, a
    bench's next mode), samples with the version it was planned under."""
    gate = PassGate()
    assert not gate.pause()  # no pass in flight
    gate.resume(4)
    with gate.running(3):
        assert gate.version == 4
    with gate.running(4):
        assert gate.version == 4
    gate.pause()
    gate.resume(5, end=True)  # the last step's update: the rollout ends, no pass of it starts after
    with gate.running(0):  # a new run on the same engines starts again from its own version
        assert gate.version == 0


def test_a_streamed_async_job_needs_no_segments():
    """rollout.stream: an update never waits for a pass, and new prompts are fed as groups are taken, so whole
    answers (rollout.partial_tokens=0) are valid where async without it needs segments to bound the update's wait."""
    cfg = load_config(None, [*IN_PASS, "rollout.partial_tokens=0", "rollout.stream=true"])
    assert cfg.rollout.stream and cfg.rollout.partial_tokens == 0
    with pytest.raises(ConfigError, match="rollout.partial_tokens=0 is invalid"):
        load_config(None, [*IN_PASS, "rollout.partial_tokens=0"])
