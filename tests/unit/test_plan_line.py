"""The switch plan's line says what a GPU does with a co-located one_step_off or async job: it time-slices the
engine's and the trainer's processes (0.99x measured on an H200), so only a split placement overlaps them. Built
for a device given as an argument, so the CPU checks what a CUDA job prints."""

from __future__ import annotations

import pytest

from colocate.cli import main
from colocate.config import load_config
from colocate.job.placement import TWO_PROCESSES_ON_ONE_GPU, plan_line

ASYNC = ["algo.mode=async", "rollout.partial_tokens=2"]
SPLIT = ["placement.engine_slots=1", "engine.tp=1"]


@pytest.mark.parametrize("overrides", [["algo.mode=one_step_off"], ASYNC])
def test_a_colocated_overlap_on_cuda_is_said_to_be_time_sliced(overrides):
    cfg = load_config(None, overrides)
    line = plan_line(cfg, "the reason", device="cuda")
    assert line.startswith("the reason; ") and "time-slices" in line and "placement.engine_slots > 0" in line
    assert f"{TWO_PROCESSES_ON_ONE_GPU}x" in line and f"algo.mode={cfg.algo.mode}" in line


@pytest.mark.parametrize("overrides, device", [
    (["algo.mode=one_step_off"], "cpu"),  # two processes on cores: the CPU's own matter (docs/async.md)
    (ASYNC, "cpu"),
    ([], "cuda"),  # sync mode overlaps nothing anywhere
    (["algo.mode=one_step_off", *SPLIT], "cuda"),  # split: the engines have GPUs of their own
    ([*ASYNC, *SPLIT], "cuda"),
])
def test_the_line_is_the_plans_reason_elsewhere(overrides, device):
    assert plan_line(load_config(None, overrides), "the reason", device=device) == "the reason"


def test_validate_for_a_gpu_node_prints_it_and_for_this_cpu_does_not(capsys, tmp_path):
    out = [f"logging.output_dir={tmp_path / 'out'}", "logging.tensorboard=false"]
    assert main(["validate", *ASYNC, *out, "--gpus", "2", "--gpu-memory-gib", "80"]) == 0
    plan = capsys.readouterr().out.split("# switch plan:")[1].splitlines()[1]
    assert "algo.mode=async" in plan and "time-slices" in plan and "placement.engine_slots > 0" in plan
    assert main(["validate", *ASYNC, *out, "placement.device=cpu"]) == 0
    assert "time-slices" not in capsys.readouterr().out
