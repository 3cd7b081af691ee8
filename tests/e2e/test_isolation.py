"""Isolation and clean-up on the real stack: the Ray a job starts listens on loopback only; two jobs at once on
one machine never map each other's segments and both finish with verified syncs (docs/security.md). What
`colocate clean RUN_DIR` removes after a SIGKILLed controller is tests/e2e/test_faults.py's (d), whose job also
resumes afterwards: one job start for both."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from colocate.host.procfs import process_tree
from colocate.host.shm import SEGMENT_PREFIX, SHM_DIR, segment_job
from tests.e2e.conftest import ROOT, small_job

pytestmark = pytest.mark.e2e

COLOCATE = str(Path(os.sys.executable).parent / "colocate")
GATE_ENV = "COLOCATE_TEST_GATE"
TINY = ["rollout.num_prompts=4", "rollout.num_samples=4", "rollout.max_tokens=4", "engine.kv_cache_gib=0.125",
        "logging.progress=false", f"model.cache_dir={ROOT / '.cache' / 'models'}"]


def wait_for_gate(prompt: str, response: str, answer: str) -> float:
    """A reward that holds its job in the first step's scoring until the test opens the gate: both jobs are then
    up at the same time, every actor and segment in place."""
    while not os.path.exists(os.environ[GATE_ENV]):
        time.sleep(0.2)
    return 0.5


# --------------------------------------------------------------------------------------------------- helpers

def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    listening = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                addr, port = fields[1].split(":")
                listening[fields[9]] = (_address(addr), int(port, 16))
    found = []
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        found += [(pid, str(listening[link[8:-1]][0]), listening[link[8:-1]][1])
                  for link in links if link.startswith("socket:[") and link[8:-1] in listening]
    return found


def is_loopback(address: str) -> bool:
    addr = ipaddress.ip_address(address)
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def record(out: Path) -> dict | None:
    try:
        return json.loads((out / "job.json").read_text())
    except (OSError, ValueError):
        return None


def mapped_segments(pids: list[int]) -> set[str]:
    """colocate segment names the processes map (unlinked ones too: maps keep the name, marked deleted)."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names |= {line.split(f"{SHM_DIR}/", 1)[1].split()[0] for line in maps.splitlines()
                  if f"{SHM_DIR}/{SEGMENT_PREFIX}" in line}
    return names


def launch(out: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([COLOCATE, "launch", "configs/default.yaml", *TINY, f"logging.output_dir={out}",
                             *overrides], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def wait_until(condition, procs: list[subprocess.Popen], timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        for proc in procs:
            assert proc.poll() is None, f"a job ended before {what}: {proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, f"timeout waiting for {what}"
        time.sleep(0.5)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ----------------------------------------------------------------------------------------------------- tests

def test_the_ray_a_job_starts_listens_on_loopback_only(tmp_path):
    import ray

    from colocate.job.runtime import Runtime

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    runtime = Runtime(small_job(tmp_path))
    runtime._init_ray()  # exactly as Runtime.start brings Ray up
    try:
        ray.get(ray.remote(lambda: 1).remote())  # a worker too
        ours = [e["pid"] for e in process_tree(os.getpid())[1:]]  # gcs_server, raylet, agents, workers
        sockets = listening_sockets(ours)
        assert len(sockets) >= 4, sockets
        assert [s for s in sockets if not is_loopback(s[1])] == [], "a Ray process listens beyond loopback"
        assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
        assert ray.get_runtime_context().namespace == f"colocate-{runtime.job}"
    finally:
        ray.shutdown()


def test_two_jobs_at_once_never_touch_each_others_segments(tmp_path):
    gate = tmp_path / "gate"
    outs = [tmp_path / "a", tmp_path / "b"]
    # different shapes on purpose: one job of two slots (FSDP over 2 ranks, an engine with TP=2), one of one
    shapes = [["placement.num_slots=2", "engine.tp=2"], ["placement.num_slots=1", "engine.tp=1"]]
    procs = [launch(out, *shape, "algo.num_steps=2", "sync.verify=full",
                    "rollout.reward_fn=tests.e2e.test_isolation:wait_for_gate", env={GATE_ENV: str(gate)})
             for out, shape in zip(outs, shapes)]
    try:
        # both held in their first step's scoring: every actor, worker and segment of both jobs is up
        wait_until(lambda: all((record(o) or {}).get("state") == "running" for o in outs), procs, 600,
                   "both jobs running")
        records = [record(o) for o in outs]
        tokens = [r["job"] for r in records]
        assert tokens[0] != tokens[1]
        for r in records:
            maps = mapped_segments([e["pid"] for e in r["processes"]])
            assert maps, f"job {r['job']} maps no colocate segment"
            assert {segment_job(name) for name in maps} == {r["job"]}, maps  # never the other job's
        gate.touch()
        results = [proc.communicate(timeout=600) for proc in procs]
    finally:
        stop(procs)
    for proc, (_, stderr) in zip(procs, results):
        assert proc.returncode == 0, stderr[-3000:]
    for out in outs:  # sync.verify=full: a step whose engine weights differed from the trainer's would fail
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
        assert [s["step"] for s in steps if "event" not in s] == [0, 1]
        assert record(out)["state"] == "closed"
