"""A job across two Ray nodes on this machine: two raylets with one CPU slot each (Ray's own
`ray.cluster_utils.Cluster`), one engine (TP=1) per node, FSDP2 over both,
submitted with `colocate submit`; the weights must equal the trainers' on both nodes after every sync, and
`colocate stop` ends it. A cluster
of the wrong shape is refused in one line before any actor starts. The cluster goes down whatever happened, and
no Ray process may be left."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, assert_nothing_left, colocate_processes, shm_segments
from tests.e2e.test_faults import thread_niceness

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
SMALL = ["algo.num_steps=2", "rollout.num_prompts=4", "rollout.num_samples=4", "rollout.max_tokens=4",
         "engine.kv_cache_gib=0.125", "placement.num_slots=2", "engine.tp=1", "sync.verify=full",
         f"model.cache_dir={ROOT / '.cache' / 'models'}", "logging.progress=false"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    from ray._private.utils import write_ray_address
    from ray.cluster_utils import Cluster

    before = (colocate_processes(), shm_segments())
    # The raylets, and the jobs they run, inherit this environment: this venv's Python first (a submitted job
    # runs `python -m colocate.cli`). Token auth stays off: this process's Ray reads its auth mode once, at
    # import, before a fixture could set it (tests/e2e/test_jobs.py and test_cluster.py cover tokens).
    env = {"RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dashboard_port = free_port()
    # A temp dir of the cluster's own (short: Ray's socket paths live under it), for its address file above all.
    # Ray's job supervisor sets a submitted driver's RAY_ADDRESS from <temp dir>/ray_current_cluster (Ray 2.60,
    # dashboard/modules/job/job_supervisor.py, _get_driver_env_vars), and Cluster writes that file under the
    # default /tmp/ray whatever the head's temp dir. Shared, it names whichever cluster on this machine started
    # last (another suite's), and the job `colocate submit` sent here would run there.
    temp_dir = Path(tempfile.mkdtemp(prefix="cn-", dir="/tmp"))
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port, "temp_dir": str(temp_dir),
            # Ray's default (52365) is taken by any other Ray on the machine started first (a job beside this
            # one): the head's agent then serves no HTTP, and the Job API answers "No available agent". None is
            # port 0 (Ray 2.60, _private/node.py), bound by the agent itself: no other process can take it between
            # a choice and the bind, as one chosen free here could be. Cluster.add_node does so for the second node.
            "dashboard_agent_listen_port": None})
        write_ray_address(cluster.address, str(temp_dir))
        # In the head's temp dir (Ray's default for a node joining), so in the head's session directory: its own
        # runtime_env directory, or the two raylets' agents would unpack a submitted job's working_dir into one
        # place, and Ray 2.60 unpacks with overwrite (runtime_env/working_dir.py create -> packaging.py
        # download_and_unpack_package: shutil.rmtree of the package): the second node's first actor would delete
        # and unzip again the package the head's driver imports from, and an import in that window fails
        # (seen once: ModuleNotFoundError: colocate.rollout.env_workers). On a real cluster each node has its own.
        cluster.add_node(num_cpus=1, runtime_env_dir_name="runtime_resources_node2")
        cluster.wait_for_nodes()
        yield {"gcs": cluster.address, "job_server": f"http://127.0.0.1:{dashboard_port}", "env": dict(os.environ),
               "cluster": cluster}
    finally:
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert_nothing_left(*before)


def records(path: Path) -> list[dict]:
    """The job's records so far (none before it wrote any; a line being written is not read yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def actor_processes() -> set[int]:
    return {pid for pid, cmdline in colocate_processes() if "TrainerActor" in cmdline or "EngineActor" in cmdline}


def test_a_job_across_two_nodes_syncs_exactly_on_both_and_stop_ends_it(two_nodes, tmp_path):
    """Submitted with `colocate submit --no-wait`, it runs across both nodes with every sync verified in full; then
    `colocate stop` ends it and its actors. (One job for both: a job start is most of either's time; `submit`
    following a job to its end is tests/e2e/test_jobs.py's.)"""
    out = tmp_path / "out"
    submitted = subprocess.run([str(BIN / "colocate"), "submit", "--no-wait", "--address", two_nodes["job_server"],
                                *SMALL, "algo.num_steps=100000", f"logging.output_dir={out}"],
                               cwd=ROOT, env=two_nodes["env"], capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    job = submitted.stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 420
    # sync.verify=full compares every engine tensor with the trainers' after each sync and fails the job if any
    # differs: two steps done means two exact syncs on both nodes
    while True:
        lines = records(out / "metrics.jsonl")
        if len([r for r in lines if "event" not in r]) >= 2:
            break
        assert time.monotonic() < deadline, "the job never finished two steps"
        assert not [r for r in lines if r.get("event") == "error"], lines[-1]  # e.g. a sync that verified wrong
        time.sleep(1)
    startup = next(r for r in lines if r.get("event") == "startup")
    placement = startup["placement"]
    # one slot per node: the trainers span both nodes, each engine sits on its own node beside the rank feeding it
    assert len(set(placement["slot_nodes"])) == 2
    assert placement["trainer_nodes"] == placement["slot_nodes"]
    assert placement["engine_nodes"] == placement["slot_nodes"]
    assert placement["pairs"] == [[0, 0], [1, 0]]
    assert startup["sync_method"] == "gather"  # in place would write across nodes
    actors = actor_processes()
    assert len(actors) == 4  # a trainer and an engine on each node
    # a cluster the job joins (its raylets started by this process): the actors at the raylets' priority, not
    # at Ray's worker default of nice 15 below it (ray_session.ACTOR_PRIORITY_ENV)
    niceness = {pid: thread_niceness(pid) for pid in actors}
    assert all(n == {os.getpriority(os.PRIO_PROCESS, 0)} for n in niceness.values()), niceness

    stopped = subprocess.run([str(BIN / "colocate"), "stop", job, "--address", two_nodes["job_server"]],
                             cwd=ROOT, env=two_nodes["env"], capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    deadline = time.monotonic() + 60
    while actor_processes() and time.monotonic() < deadline:
        time.sleep(1)
    assert not actor_processes(), "the stopped job's actors are still running"
    # the job unwound on SIGTERM (its actors and vLLM's segments released: the fixture checks nothing is left).
    # Ray's job server serves the log file as its tailer has copied it, which may lag the entrypoint's last line
    # on a loaded machine (seen once in a CI run beside other work): read it again until the line is there.
    deadline = time.monotonic() + 30
    while True:
        logs = subprocess.run([str(BIN / "colocate"), "logs", job, "--address", two_nodes["job_server"]],
                              cwd=ROOT, env=two_nodes["env"], capture_output=True, text=True, timeout=120)
        if "colocate: stopped (SIGTERM)" in logs.stdout or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "colocate: stopped (SIGTERM)" in logs.stdout, logs.stdout[-2000:]


def test_a_cluster_of_the_wrong_shape_is_refused_before_any_actor(two_nodes, tmp_path):
    env = {**two_nodes["env"], "RAY_ADDRESS": two_nodes["gcs"]}
    refused = subprocess.run([str(BIN / "colocate"), "launch", "--address", two_nodes["gcs"], *SMALL,
                              "engine.tp=2", f"logging.output_dir={tmp_path / 'out'}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("colocate:")]
    assert len(lines) == 1 and "engine.tp=2 is invalid on this Ray cluster" in lines[0], refused.stderr[-2000:]
    assert "largest node has 1 CPU cores" in lines[0]


def test_a_split_job_across_two_nodes_broadcasts_on_the_node_address_with_updates_inside_streamed_passes(
        two_nodes, tmp_path):
    """Split placement across the nodes, as a GPU cluster runs it: the trainer rank on one node, the engine on the
    other, every sync broadcast over a gloo group whose store the trainer opens on its node's address (not
    loopback: the engine's process is on another raylet), while the engine's streamed passes run on
    (algo.mode=async, rollout.update_in_pass=keep, rollout.stream). sync.verify=full compares every engine tensor
    with the trainer's after each sync: three steps done are three exact broadcasts across the nodes."""
    import ray

    out = tmp_path / "out"
    env = {**two_nodes["env"], "RAY_ADDRESS": two_nodes["gcs"]}
    done = subprocess.run([str(BIN / "colocate"), "launch", "--address", two_nodes["gcs"], *SMALL,
                           "placement.engine_slots=1", "algo.mode=async", "rollout.update_in_pass=keep",
                           "rollout.stream=true", "rollout.partial_tokens=2", "rollout.max_lag=2",
                           "algo.num_steps=3", "checkpoint.at_end=false", f"logging.output_dir={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = records(out / "metrics.jsonl")
    assert [r["step"] for r in lines if "event" not in r] == [0, 1, 2]
    startup = next(r for r in lines if r.get("event") == "startup")
    placement = startup["placement"]
    assert len(set(placement["trainer_nodes"] + placement["engine_nodes"])) == 2
    assert set(placement["trainer_nodes"]).isdisjoint(placement["engine_nodes"])
    assert startup["sync_method"] == "broadcast"
    assert startup["sync_hosts"] == [ray.util.get_node_ip_address()] != ["127.0.0.1"]  # the nodes' address
    for r in lines:
        if "event" not in r:
            assert r["rollout"]["max_lag"] <= 2 and r["rollout"]["num_groups"] == 4


def test_a_lost_worker_node_ends_the_job_naming_it(two_nodes, tmp_path):
    """Last in the module: it takes the second node away. The job, joined from this (head) node, loses the
    trainer rank and the engine on the other node; it stops naming one of them and that node, within Ray's own
    detection time, and leaves nothing behind (the fixture checks, after the cluster is down)."""
    out = tmp_path / "out"
    env = {**two_nodes["env"], "RAY_ADDRESS": two_nodes["gcs"]}
    job = subprocess.Popen([str(BIN / "colocate"), "launch", "--address", two_nodes["gcs"], *SMALL,
                            "algo.num_steps=100000", f"logging.output_dir={out}"],
                           cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or not any("event" not in r for r in records(out / "metrics.jsonl")):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended or never finished a step"
        time.sleep(0.5)
    cluster = two_nodes["cluster"]
    worker_node = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
    lost = worker_node.node_id
    cluster.remove_node(worker_node)
    _, stderr = job.communicate(timeout=300)  # a job that never notices fails here
    assert job.returncode == 1, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if line.startswith("colocate: error:"))
    assert f"node {lost[:8]}" in line and "died during" in line, line
