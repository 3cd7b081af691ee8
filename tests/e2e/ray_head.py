"""A Ray head of a test's own: `ray start --head --block` in a session of its own, on loopback, with token auth
and every port chosen free, ended through that process only.

`ray stop` would end every Ray on the machine, other tests' heads and jobs included; and a head that takes
Ray's default ports (its dashboard agent's 52365 above all) collides with whatever else runs here: a second
head's Job API then answers "No available agent to submit job"."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import requests

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(pid))
    return tree


def _descendants(root: int) -> set[int]:
    tree, found, todo = _children(), set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += tree.get(pid, [])
    return found


def _with_marker(marker: str) -> set[int]:
    """Processes whose command line names our temp dir (Ray's daemons pass their session and log dirs)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(int(pid))
        except OSError:
            continue
    return found


def _alive(pids: set[int]) -> set[int]:
    """Still running (a zombie waiting for init to reap it has no command line and no longer counts)."""
    alive = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.add(pid)
        except OSError:
            continue
    return alive


class Head:
    def __init__(self, url: str, token_file: Path, env: dict[str, str], gcs_address: str):
        self.url, self.token_file, self.env, self.gcs_address = url, token_file, env, gcs_address
        self.headers = {"Authorization": f"Bearer {token_file.read_text()}"}

    def client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.url, headers=self.headers)

    def colocate(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60):
        """The colocate command line as a user runs it (no Ray auth variables: only --token-file, if given)."""
        return subprocess.run([str(BIN / "colocate"), *args], env=env or client_env(), capture_output=True,
                              text=True, timeout=timeout, check=False)


def client_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_API_SERVER"))}
    return {**env, **extra}


def _stop_jobs(head: Head, timeout_s: float = 20) -> None:
    """A job still running when the head goes would outlive it (Ray starts entrypoints in sessions of their own),
    as one would if a test failed before stopping its job."""
    try:
        client = head.client()
        running = [j.submission_id for j in client.list_jobs() if not j.status.is_terminal() and j.submission_id]
        for job in running:
            client.stop_job(job)
        for job in running:
            wait_status(client, job, {"STOPPED", "SUCCEEDED", "FAILED"}, timeout_s)
    except Exception as e:  # noqa: BLE001 -- the head may be what failed; ending it is what matters now
        print(f"could not stop the jobs on {head.url}: {e}", file=sys.stderr)


def _wait_ready(head: Head, agent_port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    """The dashboard answers, and so does the head's dashboard agent, which the Job API hands every job to.

    An agent whose port was taken after free_port() chose it stays alive without serving and never registers
    (Ray 2.60, dashboard/agent.py); every submission then fails with "No available agent", as one did with a
    second suite running beside this one. Raises _NotReady naming what did not come up."""
    deadline = time.monotonic() + timeout_s
    for url in (f"{head.url}/api/version", f"http://127.0.0.1:{agent_port}/api/healthz"):
        while True:
            if proc.poll() is not None:
                raise _NotReady(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(url, headers=head.headers, timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if "Failed to start HTTP server" in _agent_log(log.parent):  # its port taken: it will never serve
                raise _NotReady(f"the Ray head's dashboard agent could not listen on {agent_port}")
            if time.monotonic() > deadline:
                raise _NotReady(f"{url} of the Ray head did not answer within {timeout_s} s:\n"
                                f"{log.read_text()[-3000:]}")
            time.sleep(0.3)


class _NotReady(RuntimeError):
    pass


def _agent_log(tmp: Path) -> str:
    try:
        return (tmp / "ray" / "session_latest" / "logs" / "dashboard_agent.log").read_text(errors="replace")
    except OSError:
        return ""


def _end_head(proc: subprocess.Popen, ours: set[int], timeout_s: float = 30) -> dict[int, str]:
    """SIGTERM to `ray start --block` alone: it stops what it started (a signal to the whole group at once
    leaves it waiting on daemons already gone); then anything of ours still there is killed and returned."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + timeout_s
    while _alive(ours) and time.monotonic() < deadline:
        time.sleep(0.5)
    killed = {}
    for pid in _alive(ours):
        try:
            killed[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return killed


def wait_status(client, job_id: str, wanted: set[str], timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while (status := str(client.get_job_status(job_id))) not in wanted:
        assert time.monotonic() < deadline, f"{job_id} still {status}, expected one of {wanted}"
        time.sleep(0.3)
    return status


@contextlib.contextmanager
def ray_head(num_cpus: int = 2, num_attempts: int = 2) -> Iterator[Head]:
    """A head that is ready to take jobs; one that is not (a port chosen free and taken before Ray bound it) is
    ended, and started again with other ports."""
    for attempt in range(1, num_attempts + 1):
        tmp = Path(tempfile.mkdtemp(prefix="cj-", dir="/tmp"))  # short: Ray's socket paths live under it
        proc, head, agent_port = _start_head(tmp, num_cpus)
        try:
            _wait_ready(head, agent_port, proc, tmp / "head.log")
            break
        except _NotReady:
            killed = _end_head(proc, _descendants(proc.pid) | _with_marker(str(tmp)))
            shutil.rmtree(tmp, ignore_errors=True)
            assert not killed, f"processes of our Ray head still there after it stopped (killed): {killed}"
            if attempt == num_attempts:
                raise
    try:
        yield head
    finally:
        _stop_jobs(head)
        killed = _end_head(proc, _descendants(proc.pid) | _with_marker(str(tmp)))
        shutil.rmtree(tmp, ignore_errors=True)
    assert not killed, f"processes of our Ray head still there after it stopped (killed): {killed}"


def _start_head(tmp: Path, num_cpus: int) -> tuple[subprocess.Popen, Head, int]:
    token = tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    dashboard = free_port()
    # Every port chosen here, so a head that another test started with Ray's defaults cannot collide with ours.
    ports = {f"--{name}": free_port() for name in (
        "port", "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
        "metrics-export-port", "runtime-env-agent-port", "node-manager-port", "object-manager-port")}
    env = {**client_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    with open(tmp / "head.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                                 "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                                 f"--num-cpus={num_cpus}", f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats",
                                 *(f"{k}={v}" for k, v in ports.items())],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(f"http://127.0.0.1:{dashboard}", token, env, gcs_address=f"127.0.0.1:{ports['--port']}")
    return proc, head, ports["--dashboard-agent-listen-port"]
