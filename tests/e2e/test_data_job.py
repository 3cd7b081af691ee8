"""A job on prompts from files with combined rewards (configs/math.yaml: the shipped arithmetic set, math + char
rewards), through `colocate launch` as a user runs it: each reward's mean is in every step's record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_a_job_on_prompt_files_logs_each_reward(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "colocate"), "launch", "configs/math.yaml", "algo.num_steps=2",
         "rollout.num_prompts=4", "rollout.num_samples=4", "engine.kv_cache_gib=0.125", f"logging.output_dir={out}",
         f"model.cache_dir={ROOT / '.cache' / 'models'}", "logging.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=420, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert 0 <= r["reward_math_mean"] <= 1 and 0 <= r["reward_char_mean"] <= 1
        assert r["reward_mean"] == pytest.approx(r["reward_math_mean"] + 0.5 * r["reward_char_mean"])
