"""algo.mode=one_step_off resumed from what a checkpoint keeps of the rollouts (the prompt stream's place and the
pool, with the next step's groups generated ahead in it) trains exactly what the uninterrupted run trains: the
same groups, their tokens and their versions, step by step; no prompt lost, none trained twice (counted).

The real controller, Passes, rollout pool and prompt stream; the engine is faked at its actor boundary
(run_pass), deterministic in each segment's seed as vLLM's seeded sampling is, and it stops at its quota of
complete groups and aborts the rest, as the real one does. The real-stack exact resume of sync mode is
tests/e2e/test_resume.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from colocate.engine.requests import RequestResult
from colocate.job.controller import Controller
from colocate.job.preflight import ONE_STEP_OFF_PLAN
from colocate.rollout.passes import Passes
from colocate.rl.tasks import PromptStream, make_task
from tests.unit.test_switching_order import FakeEngine, make_controller

NUM_STEPS, STOP_AFTER = 6, 2


class FakeGeneratingEngine(FakeEngine):
    def do_run_pass(self, requests, sampling, num_groups_wanted, version=0):
        """Run the requests of the first `num_groups_wanted` groups (by id) to the segment's end; abort the
        others after one token. An answer's tokens follow from its segment's seed, and so does whether it stops
        early (two in three: 1-3 tokens and EOS) or uses its whole segment (unfinished unless final: partial
        rollout leaves such a group incomplete, so a pass may end with only some groups complete)."""
        complete = sorted({r.group for r in requests})[:num_groups_wanted]
        results = []
        for r in requests:
            stops = r.seed % 3 != 0
            length = (min(r.max_tokens, 1 + r.seed % 3) if stops else r.max_tokens) if r.group in complete else 1
            tokens = [5 + (r.seed + j) % 40 for j in range(length)]
            finish = ("stop" if stops else "length") if r.group in complete else None
            results.append(RequestResult(r.request_id, tokens, [-0.5] * length, finish, 0))
        return {"results": results, "timeline": [(0.0, len(requests))], "seconds": 0.0}


class _Tokenizer:
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[5 + ord(c) % 40 for c in text])

    def decode(self, ids):
        return "2"


def controller_with_rollouts(monkeypatch, tmp_path, overrides, state=None) -> Controller:
    tmp_path.mkdir()

    def passes(cfg, runtime):  # the real passes, pool and prompt stream over the generating fake engine
        runtime.engines[0] = FakeGeneratingEngine("engine 0", [], {})
        runtime.tokenizer = _Tokenizer()
        return Passes(cfg, runtime.engines, runtime.tokenizer,
                      PromptStream(make_task(cfg.rollout.task, length=cfg.rollout.task_length), seed=cfg.rollout.seed))

    controller = make_controller(ONE_STEP_OFF_PLAN, [], monkeypatch, tmp_path, checkpoint=False, evaluate=False,
                                 overrides=["algo.mode=one_step_off", *overrides], num_steps=NUM_STEPS, passes=passes)
    if state is not None:
        controller.load_checkpoint_state(json.loads(json.dumps(state)))  # as a checkpoint writes and reads it
    trained = controller.trained = []
    original_score = controller.score

    def score(groups):
        trained.append([(g.sample.prompt, [(a.token_ids, a.versions) for a in g.completions]) for g in groups])
        return original_score(groups)

    controller.score = score
    return controller


@pytest.mark.parametrize("overrides", [
    [],
    ["rollout.oversample=1.5", "rollout.leftover=carry", "rollout.max_lag=1"],  # carried answers restarted
    ["rollout.partial_tokens=2", "rollout.max_tokens=4", "rollout.max_lag=2"],
], ids=["plain", "oversample_carry", "partial_rollout"])
def test_a_resumed_one_step_off_run_trains_what_the_uninterrupted_one_does(overrides, monkeypatch, tmp_path):
    overrides = ["rollout.num_prompts=4", "rollout.num_samples=2", *overrides]
    whole = controller_with_rollouts(monkeypatch, tmp_path / "whole", overrides)
    whole.run_steps(NUM_STEPS)

    first = controller_with_rollouts(monkeypatch, tmp_path / "first", overrides)
    for step in range(STOP_AFTER + 1):
        first.step(step, num_steps=NUM_STEPS)
    saved = first.checkpoint_state(STOP_AFTER)  # what save_checkpoint keeps after step STOP_AFTER's sync
    resumed = controller_with_rollouts(monkeypatch, tmp_path / "resumed", overrides, state=saved)
    resumed.run_steps(NUM_STEPS, first=STOP_AFTER + 1)

    assert first.trained + resumed.trained == whole.trained
    # counted: each step trains rollout.num_prompts groups (partial rollout: those complete, at least one), and
    # no group of the run is trained twice
    prompts = [(step, group[0]) for step, groups in enumerate(whole.trained) for group in groups]
    partial = any(o.startswith("rollout.partial_tokens") for o in overrides)
    assert all(1 <= len(groups) <= 4 if partial else len(groups) == 4 for groups in whole.trained)
    groups = [group for groups in whole.trained for group in groups]
    assert len({json.dumps(g) for g in groups}) == len(groups) == len(prompts)
    # every token trained at step k >= 1 is at least a version old and within the lag cap
    lag_cap = int(next((o.split("=")[1] for o in overrides if o.startswith("rollout.max_lag")), 1))
    for step, groups in enumerate(whole.trained[1:], start=1):
        lags = {step - v for _, answers in groups for _, versions in answers for v in versions}
        assert lags and min(lags) >= 1 and max(lags) <= lag_cap, (step, lags)
