"""Every "auto" decided once, in the driver (colocate/job/resolve.py): what the actors receive has none left."""

from __future__ import annotations

import dataclasses

import pytest

import colocate.job.resolve
import colocate.trainer.offload
from colocate.cli import main
from colocate.config import load_config
from colocate.job.preflight import SwitchPlan
from colocate.job.resolve import resolve_job

AUTO_KEYS = ["placement.device", "engine.sleep_level", "trainer.offload", "engine.sleep_backend",
             "engine.enforce_eager", "sync.method", "sync.delta"]


def values(cfg, keys):
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys}


def test_on_the_cpu_every_auto_is_decided_and_said_why():
    cfg = load_config(None, [])
    assert set(values(cfg, AUTO_KEYS).values()) == {"auto"}
    resolved = resolve_job(cfg, switch=SwitchPlan(2, True, "engine sleeps (level 2): ...; trainer state offloaded"))
    assert values(resolved.config, AUTO_KEYS) == {
        "placement.device": "cpu", "engine.sleep_level": "2", "trainer.offload": "true",
        "engine.sleep_backend": "portable", "engine.enforce_eager": "true", "sync.method": "in_place",
        "sync.delta": "false"}
    assert [d.key for d in resolved.decisions] == AUTO_KEYS
    why = {d.key: d.why for d in resolved.decisions}
    assert why["engine.sleep_level"] == "engine sleeps (level 2): ..." and why["trainer.offload"] == \
        "trainer state offloaded"
    assert cfg.engine.sleep_level == "auto"  # the user's config is left as it was


def test_what_the_user_chose_is_kept_and_not_listed():
    cfg = load_config(None, ["engine.sleep_level=1", "trainer.offload=false", "sync.method=gather",
                             "engine.enforce_eager=false", "placement.device=cpu"])
    resolved = resolve_job(cfg)
    assert values(resolved.config, AUTO_KEYS)["engine.sleep_level"] == "1"
    assert resolved.switch.engine_sleep_level == 1 and not resolved.switch.trainer_offload
    assert [d.key for d in resolved.decisions] == ["engine.sleep_backend", "sync.delta"]
    assert resolved.config.engine.enforce_eager == "false" and resolved.sync_method == "gather"


def test_across_nodes_the_gather_protocol():
    resolved = resolve_job(load_config(None, []), switch=SwitchPlan(2, True, "x"), multi_node=True)
    assert resolved.sync_method == "gather"


CUDA_VALUES = {"placement.device": "cuda", "engine.sleep_level": "0", "trainer.offload": "false",
               "engine.sleep_backend": "vllm", "engine.enforce_eager": "false", "sync.method": "gather",
               "sync.delta": "false"}


@pytest.mark.parametrize("problem, backend", [(None, "torch_memory_saver"), ("not installed", "pinned")])
def test_a_cuda_job_on_this_machine_is_decided_for_cuda(monkeypatch, problem, backend):
    monkeypatch.setattr(colocate.job.resolve, "resolve_device", lambda requested: "cuda")  # a GPU node
    monkeypatch.setattr(colocate.trainer.offload, "memory_saver_problem", lambda: problem)
    resolved = resolve_job(load_config(None, []), switch=SwitchPlan(0, False, "awake; stays"))
    assert values(resolved.config, AUTO_KEYS) == CUDA_VALUES
    assert resolved.config.trainer.offload_backend == backend


def test_a_described_gpu_node_leaves_the_offload_backend_to_the_node():
    """`validate --gpus` on a machine that is not the node: this process's packages say nothing of the node's."""
    resolved = resolve_job(load_config(None, []), switch=SwitchPlan(0, False, "awake; stays"), device="cuda")
    assert values(resolved.config, AUTO_KEYS) == CUDA_VALUES
    assert resolved.config.trainer.offload_backend == "auto"
    assert "trainer.offload_backend" not in [d.key for d in resolved.decisions]


def test_the_resolved_job_is_frozen():
    resolved = resolve_job(load_config(None, []), switch=SwitchPlan(2, True, "x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.device = "cuda"


def test_validate_prints_the_decisions(capsys):
    assert main(["validate"]) == 0
    out = capsys.readouterr().out
    decided = out[out.index("# decided"):].splitlines()[1:1 + len(AUTO_KEYS)]
    assert [line.split(":")[0].strip("# ") for line in decided] == AUTO_KEYS
