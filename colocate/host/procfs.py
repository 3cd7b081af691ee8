"""This machine's processes, read from /proc: who is alive (pid *and* start time, so a reused pid is never taken
for the process recorded), a process tree, a Ray session's daemons, and stopping a set of processes.

    entry = process_entry(pid)          # {pid, start} or None (gone, or a zombie)
    same_process(entry)                 # still that process, and this user's
    stop_processes(process_tree(pid))   # SIGTERM, then SIGKILL after a grace; resource trackers last
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (None: no such process, or a zombie: it holds
    nothing but its pid, and its parent, not us, reaps it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # fields 3 (state) and 22 (starttime)


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (another user's counts: it exists, our signals are refused). Only the
    pid: host/shm.py and host/rpc_dirs.py judge the pid in a name by it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_entry(pid: int) -> dict | None:
    ticks = start_ticks(pid)
    return None if ticks is None else {"pid": pid, "start": ticks}


def same_process(entry: dict) -> bool:
    """The recorded process is still alive (not a later process that reuses its pid) and is this user's."""
    try:
        owner = os.stat(f"/proc/{entry['pid']}").st_uid
    except OSError:
        return False
    return owner == os.getuid() and start_ticks(entry["pid"]) == entry["start"]


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (R, S, D, T stopped, t traced, Z zombie), None when gone."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def process_tree(root: int) -> list[dict]:
    """`root` and its descendants, as {pid, start}."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if (entry := process_entry(pid)) is not None:
            found.append(entry)
        todo.extend(children.get(pid, []))
    return found


def processes_with_env(name: str, value: str) -> list[dict]:
    """This host's processes whose environment at exec set `name`=`value`: every process of a job, whoever started
    it (an actor, an engine's forkserver and its vLLM workers, an engine restarted after the job was recorded),
    found by the token the job gave them. A forked child without an exec shows its parent's environment: it counts
    too, as it should."""
    needle = f"{name}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            entries = environ.read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if needle in entries and (entry := process_entry(int(environ.parent.name))) is not None:
            found.append(entry)
    return found


def actor_processes(_actor=None) -> dict:
    """Run inside an actor (`actor.__ray_call__.remote(actor_processes)`): its host and process tree (for an
    engine, with its vLLM workers)."""
    return {"host": socket.gethostname(), "processes": process_tree(os.getpid())}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def session_daemons(session_dir: str) -> list[int]:
    """This user's processes whose command line names Ray session `session_dir`: gcs_server, the raylet, the
    dashboard, the monitors (not the workers: Ray renames them `ray::...`)."""
    names = re.compile(re.escape(session_dir.rstrip("/")) + r"(/|\s|$)")  # not a session whose name extends it
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        entry = process_entry(int(proc.name))
        if entry and entry["pid"] != os.getpid() and same_process(entry) and names.search(cmdline(entry["pid"])):
            found.append(entry["pid"])
    return found


def session_processes(session_dir: str) -> list[dict]:
    """The session's daemons and their descendants (the raylet's workers)."""
    found = {e["pid"]: e for pid in session_daemons(session_dir) for e in process_tree(pid)}
    return [e for e in found.values() if same_process(e)]


def tcp_clients(port: int) -> set[int]:
    """Pids with an established TCP connection to `port` (any local address)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:  # ESTABLISHED, remote port
                inodes.add(fields[9])
    pids = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = [os.readlink(fd) for fd in fd_dir.iterdir()]
        except OSError:
            continue
        if any(link.startswith("socket:[") and link[8:-1] in inodes for link in links):
            pids.add(int(fd_dir.parent.name))
    return pids


def stop_processes(entries: list[dict], *, grace_s: float = 5.0, tracker_grace_s: float | None = None) -> list[dict]:
    """SIGTERM, then SIGKILL what is still alive after `grace_s`; returns the entries that were alive.

    multiprocessing's resource trackers go last, and are given the time to finish on their own
    (`tracker_grace_s`, default `grace_s`): a tracker unlinks the named semaphores (sem.mp-*) its process created
    once every holder of its pipe is gone, and nothing else knows those names (vLLM's engine creates two; killed
    first, the tracker left them behind). It ignores SIGTERM; SIGKILL only if it is still there after the grace."""
    alive = [e for e in entries if same_process(e)]
    trackers = [e for e in alive if "multiprocessing.resource_tracker" in cmdline(e["pid"])]
    _signal_and_wait([e for e in alive if e not in trackers], grace_s, (signal.SIGTERM, signal.SIGKILL))
    _signal_and_wait(trackers, grace_s if tracker_grace_s is None else tracker_grace_s, (None, signal.SIGKILL))
    return alive


def _signal_and_wait(entries: list[dict], grace_s: float, signals: tuple) -> None:
    for sig in signals:
        for entry in entries:
            if sig is not None and same_process(entry):
                try:
                    os.kill(entry["pid"], sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while any(same_process(e) for e in entries) and time.monotonic() < deadline:
            time.sleep(0.1)
