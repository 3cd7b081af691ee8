"""rollout.env_workers: the environments in Ray actors (rollout/env_workers.py), on a Ray of their own in a separate
process (no Ray session of this test process's). A pass's turn ends go out one batch per worker, the workers in
parallel: two workers step four slow episodes in two processes at overlapping times. A worker that dies fails
the calls it had and says so, and the episodes it held are gone; the other worker's go on, and a restarted
episode goes to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.e2e

SCRIPT = r"""
import json, os, ray
from colocate.config import ModelConfig
from colocate.models.sources import ensure_model, load_tokenizer
from colocate.rollout.env_workers import EnvWorker, RemoteEpisodes
from colocate.rl.tasks import Sample

path = ensure_model(ModelConfig(cache_dir=os.environ["MODEL_CACHE"]))
ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
workers = [ray.remote(EnvWorker).options(num_cpus=0).remote("tests.e2e.slow_env:SlowEnv", length=3, model_path=path,
                                                             timeout_s=10) for _ in range(2)]
tokenizer = load_tokenizer(path)
episodes = RemoteEpisodes(workers, decode=tokenizer.decode)
sample = Sample("12=", "12")
keys = [(0, i) for i in range(4)]  # answers 0 and 2 in worker 0, 1 and 3 in worker 1
prompts = episodes.start_many([(k, sample) for k in keys])
turns = episodes.step_many([(k, sample, 0, "12") for k in keys])
ray.kill(workers[1])
after_kill = episodes.step_many([(k, sample, 1, "12") for k in keys])
again = episodes.step_many([((0, 1), sample, 2, "12")])
restarted = episodes.start_many([((0, 1), sample)])  # a restarted episode goes to the worker left
restarted_step = episodes.step_many([((0, 1), sample, 0, "12")])
print(json.dumps({
    "prompts": [tokenizer.decode(p) for p in prompts],
    "observations": [tokenizer.decode(t.observation) for t in turns],
    "after_kill": [str(t) if isinstance(t, Exception) else tokenizer.decode(t.observation) for t in after_kill],
    "again": str(again[0]),
    "restarted": tokenizer.decode(restarted[0]),
    "restarted_step": tokenizer.decode(restarted_step[0].observation),
}))
ray.shutdown()
"""


def test_workers_step_in_parallel_and_a_dead_worker_is_named(tmp_path):
    env = {**os.environ, "MODEL_CACHE": str(ROOT / ".cache" / "models"), "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["prompts"] == ["12="] * 4
    steps = [tuple(int(x) for x in o.split(":")) for o in out["observations"]]
    assert steps[0][0] == steps[2][0] != steps[1][0] == steps[3][0]  # each episode's environment in its worker
    first = {pid: min(start for p, start, _ in steps if p == pid) for pid, _, _ in steps}
    last = {pid: max(end for p, _, end in steps if p == pid) for pid, _, _ in steps}
    a, b = first
    assert first[a] < last[b] and first[b] < last[a]  # the two workers stepped at overlapping times
    assert out["after_kill"][0].count(":") == 2 and out["after_kill"][2].count(":") == 2  # worker 0 goes on
    for i in (1, 3):
        assert "environment worker 1 died" in out["after_kill"][i] and "at turn 1" in out["after_kill"][i]
    assert "its worker died earlier" in out["again"] and "at turn 2" in out["again"]
    assert out["restarted"] == "12=" and int(out["restarted_step"].split(":")[0]) == steps[0][0]  # in worker 0
