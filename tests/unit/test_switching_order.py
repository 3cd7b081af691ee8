"""The controller's switching order, for every switch plan: engine sleep level 0/1/2 x trainer offload on/off x
checkpoint and evaluation due or not. Fakes stand at the actor boundary (ray.get, the actors' methods, the rollout
pool, the evaluator); the controller, the checkpointer and the scoring are the real ones. Each fake actor keeps
the residency its calls imply, so the test checks what the order is for, not only the order: the engine's KV
cache never beside the trainer's gradients and optimizer state, the engine's weights back only for the sync.
The real-stack check of the same order is tests/e2e/test_runtime.py."""

from __future__ import annotations

import contextlib
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import ray

import colocate.job.controller as controller_module
from colocate.config import load_config
from colocate.job.controller import Controller
from colocate.job.groups import EngineGroup, TrainerGroup
from colocate.job.preflight import SwitchPlan
from colocate.rl.samples import Answer, Group
from colocate.rl.tasks import Sample, make_task
from colocate.trainer.stats import TrainStats

NUM_TRAINERS, NUM_STEPS = 2, 2


class Ref:
    """What a fake actor method's .remote() returns; the patched ray.get unwraps it."""

    def __init__(self, value):
        self.value = value


class Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs):
        return Ref(getattr(self.actor, "do_" + self.name)(*args, **kwargs))


class FakeActor:
    def __init__(self, name: str, log: list, state: dict):
        self.name, self.log, self.state = name, log, state

    def __getattr__(self, method):
        if method.startswith("do_"):
            raise AttributeError(method)
        return Method(self, method)

    def record(self, *entry):
        self.log.append((self.name, *entry))


def trainers_are(state: dict, where: str) -> bool:
    return set(state["trainers"].values()) == {where}


def any_grads(state: dict) -> bool:
    return any(state["grads"].values())


class FakeTrainer(FakeActor):
    def do_offload(self):
        assert self.state["trainers"][self.name] == "resident" and not self.state["grads"][self.name]
        self.state["trainers"][self.name] = "offloaded"
        self.record("offload")

    def do_onload(self):
        assert self.state["trainers"][self.name] == "offloaded"
        self.state["trainers"][self.name] = "resident"
        self.record("onload")

    def do_train_step(self, seqs, *, step, num_tokens_all_ranks, num_micro_batches, num_seqs_all_ranks, update=0):
        plan = self.state["plan"]
        assert self.state["trainers"][self.name] == "resident"
        if plan.engine_sleep_level:  # the engine's weights and KV cache are off the device while the trainer works
            assert self.state["engine"] == {"weights": False, "kv_cache": False}
            assert self.state.get("reward_model", "asleep") == "asleep"
        self.state["grads"][self.name] = True
        self.record("train_step")
        num = sum(len(s.response_ids) for s in seqs)
        return TrainStats(tokens=num, weight_sum=float(num), token_log_w=np.zeros(num, np.float32),
                          seq_log_w=np.zeros(len(seqs), np.float32))

    def do_release_grads(self):
        self.state["grads"][self.name] = False
        self.record("release_grads")
        return 0

    def do_save_checkpoint(self, directory):
        assert self.state["trainers"][self.name] == "resident"  # a save reads the state where it lives
        self.record("save_checkpoint")

    def do_memory(self):
        return {"rss_bytes": 0}


class FakeEngine(FakeActor):
    def do_sleep(self, level):
        assert not any_grads(self.state) and all(self.state["engine"].values())
        self.state["engine"] = {"weights": False, "kv_cache": False}
        self.record("sleep", level)

    def do_wake(self, tags):
        for tag in tags:
            assert not self.state["engine"][tag]
            if tag == "kv_cache":  # never beside the trainer's gradients, nor its state when it offloads
                assert not any_grads(self.state)
                assert trainers_are(self.state, "offloaded") or not self.state["plan"].trainer_offload
            self.state["engine"][tag] = True
        self.record("wake", *tags)

    def do_memory(self):
        return [{"rss_bytes": 0}]


class FakeRewardModel:
    """rollout.reward_model.RewardModel at its boundary: scores only awake, and is asleep while the trainer trains."""

    batched, kind = True, "model"

    def __init__(self, log, state):
        self.log, self.state = log, state
        self.stats = {"kind": "model", "num_scored": 0}
        state["reward_model"] = "awake"

    def __call__(self, prompts, responses, answers):
        assert self.state["reward_model"] == "awake"
        self.stats["num_scored"] += len(prompts)
        self.log.append(("reward model", "score"))
        return [0.5] * len(prompts)

    def sleep(self):
        assert self.state["reward_model"] == "awake" and not self.state["engine"]["kv_cache"]
        self.state["reward_model"] = "asleep"
        self.log.append(("reward model", "sleep"))

    def wake(self):
        assert self.state["reward_model"] == "asleep" and not any_grads(self.state)
        self.state["reward_model"] = "awake"
        self.log.append(("reward model", "wake"))

    def take_stats(self):
        stats, self.stats = self.stats, {"kind": "model", "num_scored": 0}
        return stats

    @contextlib.contextmanager
    def separate_stats(self):
        outer, self.stats = self.stats, {"kind": "model", "num_scored": 0}
        yield self.stats
        self.stats = outer

    def memory(self):
        return [{"rss_bytes": 0}]


class FakeRollouts:
    """The rollout pool at its engine boundary: the engine must be awake and the trainer out of its way."""

    def __init__(self, log, state):
        self.log, self.residency = log, state

    def generate(self, version, *, trained_version=None):
        self.residency.setdefault("generated", []).append((version, trained_version))
        assert all(self.residency["engine"].values())
        if trained_version is None:  # sync mode: the trainer is out of the engine's way
            assert not any_grads(self.residency)
            if self.residency["plan"].trainer_offload:
                assert trainers_are(self.residency, "offloaded")
        self.log.append(("engines", "rollout"))
        self.version = version

    def take(self, trained_version):
        sample = Sample("1+1=", "2")
        completions = [Answer(seed=0, max_tokens=4, token_ids=[5, 6], logprobs=[-0.1, -0.2],
                              versions=[self.version] * 2, finish_reason="stop") for _ in range(2)]
        return [Group(sample, [1, 2], completions), Group(sample, [1, 2], completions)], {"seconds": 1.0}

    def state(self):  # what a checkpoint keeps of the pool
        return {}


class FakeSync:
    def __init__(self, log, state):
        self.log, self.state = log, state

    def run(self):
        assert self.state["engine"]["weights"] and not self.state["engine"]["kv_cache"] or \
            not self.state["plan"].engine_sleep_level
        assert not any_grads(self.state) and trainers_are(self.state, "resident")
        self.log.append(("trainers", "sync"))
        return {"sync_s": 0.0}


class FakeEvaluator:
    last_answers: list = []

    def __init__(self, log, state):
        self.log, self.state = log, state

    def run(self):
        assert all(self.state["engine"].values())
        self.log.append(("engines", "eval"))
        return {"pass@1": 0.0}


def expected_order(plan: SwitchPlan, *, checkpoint: bool, evaluate: bool, reward_model: bool = False) -> list[tuple]:
    """The order docs/rollout.md and the controller's docstring give, written out from the plan."""
    trainers = [f"trainer {r}" for r in range(NUM_TRAINERS)]

    def each(*call):
        return [(t, *call) for t in trainers]

    order = each("offload") if plan.trainer_offload else []
    for _ in range(NUM_STEPS):
        order += [("engines", "rollout")]
        order += [("reward model", "score")] if reward_model else []
        order += [("engine 0", "sleep", plan.engine_sleep_level)] if plan.engine_sleep_level else []
        order += [("reward model", "sleep")] if reward_model and plan.engine_sleep_level else []
        order += each("onload") if plan.trainer_offload else []
        order += each("train_step") + each("release_grads")
        order += [("engine 0", "wake", "weights")] if plan.engine_sleep_level else []
        order += [("trainers", "sync")]
        order += each("save_checkpoint") if checkpoint else []
        order += each("offload") if plan.trainer_offload else []
        order += [("engine 0", "wake", "kv_cache")] if plan.engine_sleep_level else []
        order += [("reward model", "wake")] if reward_model and plan.engine_sleep_level else []
        order += [("reward model", "score")] if reward_model and evaluate else []
        order += [("engines", "eval")] if evaluate else []
    return order


PLANS = [pytest.param(level, offload, checkpoint, evaluate,
                      id=f"sleep{level}-{'offload' if offload else 'resident'}"
                         f"{'-checkpoint' if checkpoint else ''}{'-eval' if evaluate else ''}")
         for level, offload, checkpoint, evaluate in itertools.product((0, 1, 2), (False, True), (False, True),
                                                                       (False, True))]


def make_controller(plan: SwitchPlan, log: list, monkeypatch, tmp_path, *, checkpoint: bool, evaluate: bool,
                    on_get=lambda: None, overrides=(), num_steps=NUM_STEPS, reward_model=False,
                    passes=None) -> Controller:
    """The real controller over fake actors; `on_get` runs at each ray.get (an actor call's return). `passes`:
    (cfg, runtime) -> the rollout passes over the fake engine (default: FakeRollouts, the pool at its boundary)."""
    model = tmp_path / "model"  # what a checkpoint records of the model: its config.json
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 8}')
    # after start-up: the trainer resident (offloaded before the first rollout when the plan says so), engines awake
    names = [f"trainer {r}" for r in range(NUM_TRAINERS)]
    state = {"plan": plan, "trainers": dict.fromkeys(names, "resident"), "grads": dict.fromkeys(names, False),
             "engine": {"weights": True, "kv_cache": True}}

    def get(refs, **kwargs):  # kwargs: ray.get's timeout
        on_get()
        return [r.value for r in refs] if isinstance(refs, list) else refs.value

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(controller_module, "make_evaluator", lambda *a, **k: FakeEvaluator(log, state))
    cfg = load_config(None, [f"logging.output_dir={tmp_path}", f"algo.num_steps={num_steps}",
                             f"checkpoint.every_steps={1 if checkpoint else 0}", "checkpoint.at_end=false",
                             f"eval.every_steps={1 if evaluate else 0}", *overrides])
    reward = FakeRewardModel(log, state) if reward_model else None
    runtime = SimpleNamespace(
        switch=plan, trainers=TrainerGroup(FakeTrainer(name, log, state) for name in names),
        engines=EngineGroup([FakeEngine("engine 0", log, state)], sleeps_with=[reward] if reward else []),
        sync=FakeSync(log, state), model_path=str(model), reward_model=reward,
        tokenizer=SimpleNamespace(decode=lambda ids: "2", eos_token_id=None),
        setup=SimpleNamespace(task=make_task(cfg.rollout.task, length=cfg.rollout.task_length)))
    return Controller(cfg, runtime, rollouts=passes(cfg, runtime) if passes else FakeRollouts(log, state))


@pytest.mark.parametrize("level, offload, checkpoint, evaluate", PLANS)
def test_the_switching_order(level, offload, checkpoint, evaluate, monkeypatch, tmp_path):
    plan = SwitchPlan(level, offload, "test")
    log: list[tuple] = []
    controller = make_controller(plan, log, monkeypatch, tmp_path, checkpoint=checkpoint, evaluate=evaluate)
    controller.run_steps(NUM_STEPS)
    assert log == expected_order(plan, checkpoint=checkpoint, evaluate=evaluate)
    assert len(controller.history) == NUM_STEPS
    if checkpoint:
        assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000000", "step_00000001"]


@pytest.mark.parametrize("level, offload", [(0, False), (1, False), (2, True)])
def test_the_reward_model_sleeps_with_the_engines(level, offload, monkeypatch, tmp_path):
    """rollout.rewards=model:PATH: the reward model scores awake, sleeps after the policy's engines and before the
    trainer onloads, and wakes after their KV cache, before the next rollout; with nothing asleep it never moves."""
    plan = SwitchPlan(level, offload, "test")
    log: list[tuple] = []
    controller = make_controller(plan, log, monkeypatch, tmp_path, checkpoint=False, evaluate=True,
                                 overrides=["rollout.rewards=model:tiny-rm"], reward_model=True)
    evaluate = controller.evaluator.run

    def evaluate_with_the_reward_model():
        controller.reward_fn(["p"] * 3, ["r"] * 3, ["a"] * 3)  # the evaluation scores 3 answers
        return evaluate()

    controller.evaluator.run = evaluate_with_the_reward_model
    controller.run_steps(NUM_STEPS)
    assert log == expected_order(plan, checkpoint=False, evaluate=True, reward_model=True)
    # the step's own scoring (2 groups of 2 answers), apart from the evaluation's, which runs before the record
    assert controller.history[0]["reward_model"] == {"kind": "model", "num_scored": 4}
    assert controller.history[0]["eval"]["reward_model"] == {"kind": "model", "num_scored": 3}
    assert controller.history[0]["reward_model_mean"] == 0.5


class PhaseWatch:
    """The watchdog's phase() at its boundary: records which phase, if any, is open; it finds no fault."""

    def __init__(self):
        self.open: list[tuple[str, int | None]] = []
        self.fault = None

    def waiting(self):  # a rollout's wait on the engines (fault.engine_restarts), a phase's part
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def phase(self, name, step=None):
        self.open.append((name, step))
        try:
            yield
        finally:
            self.open.pop()


def test_every_actor_call_of_a_step_is_inside_a_watched_phase(monkeypatch, tmp_path):
    """The watchdog explains a Ray error (names the member, and the node it lost) only inside a phase. A step's
    memory figures were once read outside every phase, and a worker node lost just then ended the job with Ray's
    bare "ActorDiedError: The actor died unexpectedly", naming nothing (a CI run of test_multinode)."""
    watch, calls = PhaseWatch(), []

    def on_get():
        assert watch.open, "an actor call outside every watched phase"
        calls.append(watch.open[-1])

    controller = make_controller(SwitchPlan(1, True, "test"), [], monkeypatch, tmp_path, checkpoint=True,
                                 evaluate=True, on_get=on_get)
    controller.watchdog = watch
    controller.run_steps(NUM_STEPS)
    assert ("metrics", NUM_STEPS - 1) in calls and ("train", 0) in calls


def test_one_step_off_generates_the_next_step_while_this_one_trains(monkeypatch, tmp_path):
    """Step k trains what step k - 1 generated ahead with the weights of version k - 1 (step 0 generates its own,
    on-policy); the generation runs in the controller's background thread and is over before the sync rewrites
    the engine's weights; nothing sleeps or moves."""
    from colocate.job.preflight import ONE_STEP_OFF_PLAN

    num_steps, log = 3, []
    controller = make_controller(ONE_STEP_OFF_PLAN, log, monkeypatch, tmp_path, checkpoint=False, evaluate=False,
                                 overrides=["algo.mode=one_step_off"], num_steps=num_steps)
    trained_versions = []
    original_score = controller.score

    def score(groups):
        trained_versions.append(sorted({v for g in groups for a in g.completions for v in a.versions}))
        return original_score(groups)

    controller.score = score
    controller.run_steps(num_steps)
    state = controller.passes.residency
    assert state["generated"] == [(0, None), (0, 1), (1, 2)]
    assert trained_versions == [[0], [0], [1]]
    assert [e for e in controller.events if e.startswith("rollout")] == \
        ["rollout", "rollout.ahead", "rollout.ahead.done", "rollout", "rollout.ahead", "rollout.ahead.done",
         "rollout"]
    assert not any(call[1] in ("sleep", "wake", "offload", "onload") for call in log)
