"""The rollout modes behind one face (colocate/rollout/modes.py): every mode the config accepts has its driver, and
the controller never asks which runs. A fourth mode, written here and registered where modes are named (the
config's list and rollout.modes.MODES), runs through the real controller's steps with no controller line
touched; the controller's source names no mode."""

from __future__ import annotations

import ast
from pathlib import Path

import colocate.config.algo as algo_config
import colocate.rollout.modes as modes
from colocate.job.preflight import SwitchPlan
from colocate.rollout.modes import MODES, RolloutMode
from tests.unit.test_switching_order import NUM_STEPS, make_controller

CONTROLLER = Path(__file__).resolve().parents[2] / "colocate" / "job" / "controller.py"


def test_every_mode_the_config_accepts_has_a_driver_and_shares_its_face():
    assert sorted(MODES) == sorted(algo_config.MODES)
    face = ("take", "before_train", "before_sync", "after_sync", "state", "load_state", "close")
    for mode in MODES.values():
        assert issubclass(mode, RolloutMode) and all(callable(getattr(mode, name)) for name in face)


def test_the_controller_names_no_mode_and_keeps_no_mode_flag():
    tree = ast.parse(CONTROLLER.read_text())
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & set(MODES) - {"sync"}  # "sync" is also the name of a phase
    source = CONTROLLER.read_text()
    assert "algo.mode" not in source.split('"""', 2)[2]  # the module docstring may say what the modes do
    controller = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Controller")
    step = next(n for n in controller.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 35
    assert controller.end_lineno - controller.lineno + 1 <= 300


class EveryOtherStep(RolloutMode):
    """A fourth mode: each rollout generates two steps' groups, and the second step takes what the first left."""

    calls: list = []

    def _take(self, step):
        self.calls.append(("take", step))
        if step % 2 == 0:
            self.passes.generate(version=step)
        return self.passes.take(step)

    def before_train(self, step, num_steps):
        self.calls.append(("before_train", step))

    def before_sync(self, step):
        with self.trace.phase("rollout_wait", step):
            self.calls.append(("before_sync", step))

    def after_sync(self, step, num_steps):
        self.calls.append(("after_sync", step))


def test_a_fourth_mode_runs_through_the_controller_untouched(monkeypatch, tmp_path):
    monkeypatch.setattr(algo_config, "MODES", [*algo_config.MODES, "every_other_step"])
    monkeypatch.setitem(modes.MODES, "every_other_step", EveryOtherStep)
    EveryOtherStep.calls = []
    controller = make_controller(SwitchPlan(0, False, "test"), [], monkeypatch, tmp_path, checkpoint=True,
                                 evaluate=False, overrides=["algo.mode=every_other_step"])
    assert isinstance(controller.rollout, EveryOtherStep)
    controller.run_steps(NUM_STEPS)
    assert EveryOtherStep.calls == [(call, step) for step in range(NUM_STEPS)
                                    for call in ("take", "before_train", "before_sync", "after_sync")]
    assert controller.passes.residency["generated"] == [(0, None)]  # step 1 took what step 0 generated
    assert all("rollout_wait" in record["times"] for record in controller.history)
    assert len(controller.history) == NUM_STEPS
