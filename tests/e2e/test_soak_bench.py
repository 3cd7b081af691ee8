"""`colocate bench soak` as a user runs it, shrunk to 3 steps of the small job: every resource read each step,
the verdict and the figure written. Most of its time is the runtime's start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]
NUM_STEPS = 3


def test_soak_records_every_resource_each_step(tmp_path):
    # the overrides of conftest.launch: the default job, a fraction of a second per step
    args = ["rollout.num_prompts=4", "rollout.num_samples=4", "rollout.max_tokens=4", "engine.kv_cache_gib=0.125",
            f"logging.output_dir={tmp_path / 'out'}", f"model.cache_dir={ROOT / '.cache' / 'models'}"]
    done = subprocess.run([str(Path(sys.executable).parent / "colocate"), "bench", "soak",
                           f"algo.num_steps={NUM_STEPS}", *args, "--out", str(tmp_path)],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["complete"] and result["num_steps_done"] == NUM_STEPS
    assert result["config"]["switch"] == {"engine_sleep_level": 2, "trainer_offload": True}
    series = result["series"]
    assert all(len(values) == NUM_STEPS and None not in values for values in series.values()), series
    # every process and every kind: the controller, 2 trainer ranks, the engine actor and its 2 TP workers
    for process in ("controller", "trainer0", "trainer1", "engine0", "engine0.worker0", "engine0.worker1"):
        for kind in ("rss_bytes", "fds", "threads"):
            assert series[f"{kind}/{process}"][-1] > 0, f"{kind}/{process}"
    assert series["processes/engine0"][-1] >= 3
    for key in ("shm_entries/job", "shm_mapped_bytes/job", "shm_entries/machine", "shm_entry_bytes/machine",
                "shm_used_bytes/machine"):
        assert key in series
    assert series["shm_entries/job"][-1] > 0  # the engine's weight arena at least
    if result["config"]["device"] == "cuda":
        assert any(k.startswith("device_used_bytes/") for k in series)
    summary = result["summary"]
    assert summary["short_run"] and set(summary["resources"]) == set(series)
    assert all(row["growth"] is not None for row in summary["resources"].values())
    assert result["controller_lists"]["at_step_2"]["history"]["len"] == NUM_STEPS
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert "rss_bytes/engine0.worker0" in done.stdout  # the summary table was printed
