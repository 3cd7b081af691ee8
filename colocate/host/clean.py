"""Job records and `colocate clean`: what a dead job left on this machine, and removing exactly that.

    record = JobRecord(output_dir, job)     # the Runtime writes <output_dir>/job.json when it starts,
    record.update(actors=..., ...)          # completes it as the job comes up,
    record.update(state="closed")           # and marks it closed once its actors and segments are gone
    colocate clean RUN_DIR [--dry-run]      # after a SIGKILL, an OOM kill, a lost node: the rest goes

job.json: job (the token in the job's segment names and Ray namespace), state (starting, running, closed),
controller {pid, start}, host, uid, output_dir, ray {started, address, gcs_address, session_dir, namespace},
actors (their Ray names), processes [{pid, start}] (the job's processes on this host: its actors, their vLLM
workers, and the Ray daemons when the job started its own Ray), shm (vLLM's /dev/shm entries the job's
processes mapped; their names carry no job).

A process is the recorded one only if its pid *and* its start time (/proc/<pid>/stat, clock ticks after boot)
match: a pid reused since is never taken for the job's. Nothing of another user is touched (every removal
checks the owner), and nothing of another job: segments go by the job's token, the recorded vLLM entries only
when no living process maps them, processes by the record or by the job's own Ray session directory.

Fact (Ray 2.60, Linux): a local Ray that ray.init started shares fate with its driver. SIGKILL the controller
and gcs_server, the raylet, the dashboard and the monitors (its children) die at once; the workers (the
raylet's) exit once they notice, seconds later, vLLM's TP workers after their engine actor. Run right after the
kill, `clean` stops those stragglers (tests/e2e/test_faults.py (d): 8 processes) and removes vLLM's segments,
which nobody unlinks when its processes die that way. multiprocessing's resource trackers are stopped last and
given time to exit by themselves: each unlinks the named semaphores its process left (stop_processes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from colocate.errors import CleanError
from colocate.host.procfs import (
    cmdline,
    process_entry,
    same_process,
    session_daemons,
    session_processes,
    start_ticks,
    stop_processes,
    tcp_clients,
)
from colocate.host.rpc_dirs import remove_stale_rpc_dirs
from colocate.host.shm import SEGMENT_PREFIX, SHM_DIR, is_ours, job_segments, mapped_by, segment_pid

RECORD = "job.json"


# ---------------------------------------------------------------------------------------------------- record

class JobRecord:
    """<output_dir>/job.json, rewritten whole (a temporary file renamed over it: never read half-written)."""

    def __init__(self, output_dir: str | Path, job: str):
        self.path = Path(output_dir) / RECORD
        self.data = {"version": 1, "job": job, "state": "starting", "controller": process_entry(os.getpid()),
                     "host": socket.gethostname(), "uid": os.getuid(), "output_dir": str(Path(output_dir).resolve()),
                     "started_at": time.time(), "ray": None, "actors": [], "processes": [], "shm": []}

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{RECORD}.{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


def read_record(run_dir: str | Path) -> dict:
    path = Path(run_dir) / RECORD
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CleanError(f"{run_dir} has no {RECORD}: not the output_dir of a colocate job (or of one from "
                         "before job records)") from None
    except (OSError, ValueError) as e:
        raise CleanError(f"cannot read {path}: {e}") from None


def check_cleanable(run_dir: str | Path) -> dict:
    """The record of a job `clean` may clean here, or CleanError: another host's, another user's, running."""
    record = read_record(run_dir)
    if record.get("host") != socket.gethostname():
        raise CleanError(f"job {run_dir} ran on host {record.get('host')!r}, not this one "
                         f"({socket.gethostname()!r}): run colocate clean there")
    if record.get("uid") != os.getuid():
        raise CleanError(f"job {run_dir} belongs to uid {record.get('uid')}, not to you (uid {os.getuid()})")
    controller = record.get("controller") or {}
    if record.get("state") != "closed" and controller and same_process(controller):
        pid = controller["pid"]
        raise CleanError(f"job {run_dir} is still running (pid {pid}); stop it first: kill -INT {pid}")
    return record


def find_runs(root: str | Path = "outputs") -> list[Path]:
    """Every run directory under `root` with a job record."""
    return sorted(p.parent for p in Path(root).rglob(RECORD)) if Path(root).is_dir() else []


# ----------------------------------------------------------------------------------------------------- clean

def clean(run_dir: str | Path, *, dry_run: bool = False, say=print) -> tuple[int, int]:
    """Remove what the dead job of `run_dir` left on this machine; returns (processes stopped, segments
    removed). Prints one line per thing removed (or, with dry_run, that would be)."""
    record = check_cleanable(run_dir)
    verb = "would stop" if dry_run else "stopped"
    ray_info = record.get("ray") or {}
    processes = {e["pid"]: e for e in record.get("processes", [])}
    if ray_info.get("started") and ray_info.get("session_dir"):
        session = session_processes(ray_info["session_dir"])
        others = _other_drivers(ray_info, set(processes) | {e["pid"] for e in session})
        if others:  # only our own workers go; the daemons serve that driver too
            say(f"kept Ray session {ray_info['session_dir']}: another driver (pid {min(others)}) still uses it")
            for pid in session_daemons(ray_info["session_dir"]):
                processes.pop(pid, None)
        else:
            processes.update({e["pid"]: e for e in session})
    alive = [e for e in processes.values() if same_process(e)]
    names = {e["pid"]: cmdline(e["pid"])[:80] for e in alive}
    stopped = alive if dry_run else stop_processes(alive)
    for entry in stopped:
        say(f"{verb} process {entry['pid']} ({names[entry['pid']]})")
    if not ray_info.get("started") and record.get("actors") and ray_info.get("namespace"):
        for line in _cluster_actors(ray_info, kill=not dry_run):
            say(line)
    segments = _leftover_segments(record, dead_pids={*processes, (record.get("controller") or {}).get("pid")})
    for path in segments:
        if not dry_run:
            path.unlink(missing_ok=True)
        say(f"{'would remove' if dry_run else 'removed'} segment {path}")
    if not dry_run:
        # a killed engine's socket directory (host/rpc_dirs.py): any whose engine is gone, not this job's alone
        for path in remove_stale_rpc_dirs():
            say(f"removed vLLM socket directory {path}")
        JobRecord(run_dir, record["job"]).update(**{**record, "cleaned_at": time.time()})
    return len(stopped), len(segments)


def clean_runs(run_dirs: list[str], *, dry_run: bool = False, root: str = "outputs", say=print) -> int:
    """`colocate clean`: the given run directories (each checked before anything is removed: one that may not
    be cleaned stops the command), or every record under `root` not closed or cleaned yet (those that may not
    be cleaned are skipped with a line). Returns the exit code."""
    if run_dirs:
        for run_dir in run_dirs:
            check_cleanable(run_dir)
        todo = list(run_dirs)
    else:
        todo = []
        for run_dir in find_runs(root):
            record = read_record(run_dir)
            if record.get("state") == "closed" or "cleaned_at" in record:
                continue
            try:
                check_cleanable(run_dir)
                todo.append(run_dir)
            except CleanError as e:
                say(f"skipped: {e}")
        if not todo:
            say(f"colocate: no job under {root}/ left anything to clean")
            return 0
    for run_dir in todo:
        stopped, removed = clean(run_dir, dry_run=dry_run, say=say)
        what = "would stop" if dry_run else "stopped"
        say(f"colocate: {'checked' if dry_run else 'cleaned'} {run_dir}: {what} {stopped} process(es), "
            f"{'would remove' if dry_run else 'removed'} {removed} segment(s)")
    return 0


def _leftover_segments(record: dict, *, dead_pids: set) -> list[Path]:
    """The job's colocate segments (by token, or by the pid of one of its dead processes) and the vLLM
    entries it recorded that nobody maps now; only this user's."""
    found = {p.name: p for p in job_segments(record["job"])}
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        pid = segment_pid(path.name)
        if pid in dead_pids and start_ticks(pid) is None and is_ours(path):
            found[path.name] = path
    recorded = {name for name in record.get("shm", []) if is_ours(SHM_DIR / name)}
    for name in recorded - mapped_by(recorded):
        found[name] = SHM_DIR / name
    return sorted(found.values())


def _other_drivers(ray_info: dict, ours: set[int]) -> set[int]:
    """Processes connected to the job's own GCS that are not the session's or the job's: other drivers that
    attached to the Ray this job started (its daemons must then stay)."""
    address = ray_info.get("gcs_address") or ""
    if ":" not in address:
        return set()
    clients = tcp_clients(int(address.rsplit(":", 1)[1]))
    return {pid for pid in clients - ours if pid != os.getpid()}


def _cluster_actors(ray_info: dict, *, kill: bool) -> list[str]:
    """Kill (or list) the job's named actors on the cluster it joined, in a child process with a deadline: a
    cluster that is gone must not hang `clean`. Normally there is none: Ray kills a driver's actors with it."""
    cmd = [sys.executable, "-m", "colocate.host.clean", ray_info.get("address") or "auto", ray_info["namespace"],
           "kill" if kill else "list"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    except subprocess.TimeoutExpired:
        return [f"skipped Ray actors: the cluster at {ray_info.get('address')} did not answer in 90 s"]
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"skipped Ray actors: cannot reach the cluster at {ray_info.get('address')} ({last})"]
    return result.stdout.splitlines()


def _cluster_actors_main(address: str, namespace: str, action: str) -> None:
    import logging

    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
    for name in ray.util.list_named_actors():
        if action == "kill":
            ray.kill(ray.get_actor(name), no_restart=True)
        print(f"{'killed' if action == 'kill' else 'would kill'} Ray actor {namespace}/{name}")
    ray.shutdown()


if __name__ == "__main__":
    _cluster_actors_main(*sys.argv[1:4])
