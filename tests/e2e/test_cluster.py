"""An existing Ray cluster: a head started with `ray start` (loopback, token auth, as Ray 2.60 requires), a job
that joins it with `colocate launch --address auto`, one sent through `colocate submit` (Job API), and a job
without an address, which starts a Ray of its own beside the head."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, assert_nothing_left, colocate_processes, shm_segments
from tests.e2e.ray_head import ray_head

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
SMALL = ["algo.num_steps=1", "rollout.num_prompts=4", "rollout.num_samples=4", "engine.kv_cache_gib=0.125",
         f"model.cache_dir={ROOT / '.cache' / 'models'}", "logging.progress=false"]
# The submitted job runs on one slot (a rank, a TP=1 engine): what it shows (the Job API) has nothing to do with
# the layout, and each engine worker and rank fewer is seconds of CPU a job start. The joined job keeps two slots
# and TP=2: the one TP=2 job placed on a cluster that `ray start` made.
ONE_SLOT = ["placement.num_slots=1", "engine.tp=1"]


@pytest.fixture(scope="module")
def head():
    """One head for the module, of its own (tests/e2e/ray_head.py): `colocate launch --address auto` finds it
    through RAY_ADDRESS, as Ray's own resolution of "auto" reads that variable first."""
    before = (colocate_processes(), shm_segments())
    with ray_head() as head:
        yield head
    assert_nothing_left(*before)


def joining(head) -> dict[str, str]:
    return {**head.env, "RAY_ADDRESS": head.gcs_address}


def ray_of(out: Path) -> dict:
    """Which Ray the job ran on, from its record (job.json): one it started, or the cluster's (by its GCS port:
    Ray reports the address as the node's, not the loopback one the head was given)."""
    ray = json.loads((out / "job.json").read_text())["ray"]
    return {"started": ray["started"], "gcs_port": ray["gcs_address"].rsplit(":", 1)[1]}


def steps(path: Path) -> list[int]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["step"] for r in records if "event" not in r]


def test_launch_joins_submit_runs_and_a_local_job_stays_local(head, tmp_path):
    joined = subprocess.run([str(BIN / "colocate"), "launch", "--address", "auto", *SMALL,
                             f"logging.output_dir={tmp_path / 'joined'}"],
                            cwd=ROOT, env=joining(head), capture_output=True, text=True, timeout=420)
    assert joined.returncode == 0, joined.stderr[-2000:]
    assert steps(tmp_path / "joined" / "metrics.jsonl") == [0]
    assert ray_of(tmp_path / "joined") == {"started": False, "gcs_port": head.gcs_address.rsplit(":", 1)[1]}

    submitted = subprocess.run([str(BIN / "colocate"), "submit", "--address", head.url, *SMALL, *ONE_SLOT,
                                f"logging.output_dir={tmp_path / 'submitted'}"],
                               cwd=ROOT, env=head.env, capture_output=True, text=True, timeout=420)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    assert "succeeded" in submitted.stderr
    assert steps(tmp_path / "submitted" / "metrics.jsonl") == [0]

    # Without an address the job starts a Ray of its own, even with this head running on the machine and
    # RAY_ADDRESS naming it. What decides it is the runtime's Ray start alone (job/ray_session.py connect_ray):
    # run just that, in a process of its own, instead of a third job (a job start is a minute of CPU here).
    own = subprocess.run([sys.executable, "-c", OWN_RAY, str(tmp_path / "local")], cwd=ROOT, env=joining(head),
                         capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-2000:]
    local_ray = json.loads(own.stdout.strip().splitlines()[-1])
    assert local_ray["started"] and local_ray["address"] == "local"
    assert local_ray["gcs_address"].rsplit(":", 1)[1] != head.gcs_address.rsplit(":", 1)[1]


# the runtime's Ray start, as `colocate launch` without --address runs it, then its teardown
OWN_RAY = """
import json, sys
from colocate.config import load_config
from colocate.job.runtime import Runtime
runtime = Runtime(load_config(None, [f"logging.output_dir={sys.argv[1]}"]))
try:
    runtime._init_ray()
    print(json.dumps(runtime._ray_record()))
finally:
    runtime.close()
"""


def test_cluster_without_enough_slots_is_refused_before_any_actor(head, tmp_path):
    result = subprocess.run([str(BIN / "colocate"), "launch", "--address", "auto", *SMALL,
                             "placement.num_slots=64", "engine.tp=2", f"logging.output_dir={tmp_path / 'out'}"],
                            cwd=ROOT, env=joining(head), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("colocate:")]
    assert lines == [lines[0]] and "placement.num_slots=64" in lines[0] and "the Ray cluster" in lines[0]
