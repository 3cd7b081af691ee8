"""A job is set up once in the driver (colocate/job/setup.py): `colocate launch` through a fault and its restart
loads the tokenizer once, builds the task once, fetches the model once, plans the slots once and reads the
model's dimensions once. The actors stand behind a fake runtime here; tests/e2e/test_runtime.py counts the same
on the real one, through its start and its controllers' steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import colocate.job.run as run_module
from colocate.cli import main
from colocate.errors import JobFault
from colocate.job.controller import Controller
from colocate.job.placement import plan_slots
from colocate.models.dims import model_dims
from colocate.models.sources import ensure_model, load_tokenizer
from colocate.rl.tasks import make_task

ROOT = Path(__file__).resolve().parents[2]

# what the issue counted as built more than once per job, each a function of its own
SET_UP = (load_tokenizer, make_task, ensure_model, plan_slots, model_dims)


def count_calls(monkeypatch, function) -> list:
    """Wrap `function` in every colocate module that holds it by name (its own, and each that imported it), so
    that any call in this process is counted, whoever makes it; returns the calls' arguments, as they come."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("colocate") and getattr(m, function.__name__, None) is function]
    assert holders, function
    for module in holders:
        monkeypatch.setattr(module, function.__name__, counted)
    return calls


def count_set_up(monkeypatch) -> dict[str, list]:
    return {f.__name__: count_calls(monkeypatch, f) for f in SET_UP}


class FakeRuntime:
    """The runtime at its actor boundary: it takes the set-up it is given and starts nothing."""

    started: list = []

    def __init__(self, cfg, setup):
        self.cfg, self.setup = cfg, setup
        self.model_path, self.tokenizer, self.switch = setup.model_path, setup.tokenizer, setup.resolved.switch
        self.engines = [object()]  # a handle the controller's passes and evaluator keep; no call reaches it
        self.device, self.trainers, self.env_workers, self.reward_model = "cpu", [], [], None
        self.trainer_info = self.engine_info = []
        self.placement_report, self.reward_model_info = {}, None
        self.sync = SimpleNamespace(plan=SimpleNamespace(mode="sliced", num_bytes=0), transport="in_place",
                                    method="in_place", hosts=[])

    def __enter__(self):
        FakeRuntime.started.append(self)
        return self

    def __exit__(self, *exc):
        return None


def test_launch_sets_the_job_up_once_through_a_restart(tmp_path, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "val.jsonl").write_text(rows)
    counts = count_set_up(monkeypatch)
    FakeRuntime.started = []
    monkeypatch.setattr(run_module, "Runtime", FakeRuntime)
    attempts = []

    def run(controller):  # the first start's steps meet a fault; the restart's finish
        attempts.append(controller)
        if len(attempts) == 1:
            raise JobFault("trainer rank 0 died in train (step 0): injected by the test")
        return []

    monkeypatch.setattr(Controller, "run", run)
    # the one tokenizer serves each of the driver's uses: the data's rows, the validation rows, the restart's rows
    assert main(["launch", f"logging.output_dir={tmp_path / 'out'}", f"model.cache_dir={ROOT / '.cache' / 'models'}",
                 f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'val.jsonl'}",
                 "eval.at_end=true", "rollout.num_prompts=4", "fault.max_restarts=1",
                 "logging.progress=false", "placement.num_slots=1", "engine.tp=1"]) == 0
    assert "restart 1/1" in capsys.readouterr().err
    assert len(attempts) == len(FakeRuntime.started) == 2
    assert {name: len(calls) for name, calls in counts.items()} == dict.fromkeys(counts, 1)
    first, again = FakeRuntime.started
    assert first.setup.tokenizer is again.setup.tokenizer and first.setup.task is again.setup.task
    assert attempts[0].task is attempts[1].task is first.setup.task
    # the restart's runtime runs the decided config, restarted as the user's is: from its newest checkpoint
    assert again.setup.resolved.config.checkpoint.resume == "auto"
    assert again.setup.resolved.decisions == first.setup.resolved.decisions  # decided once, not again
