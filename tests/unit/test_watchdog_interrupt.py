"""The watchdog's interrupt reaches a main thread blocked in a (fake) ray.get, whatever SIGINT's disposition."""

from __future__ import annotations

import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from colocate.config import FaultConfig
from colocate.errors import JobFault
from colocate.job import faults
from colocate.job.faults import Member, Watchdog


def _blocking_get(limit_s: float = 15.0) -> None:
    """Ray's get without a timeout: waits in C, checks signals (PyErr_CheckSignals) about once a second."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise AssertionError("the watchdog's interrupt never reached the blocked main thread")


@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], ids=["foreground", "background"])
def test_a_stopped_worker_in_sync_interrupts_the_blocked_main_thread(monkeypatch, sigint):
    worker = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(faults.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setattr(faults, "job_members", lambda runtime: [Member("engine 0 TP worker 0", worker.pid, (0,), "node",
                                                                       engine=0)])
    cfg = FaultConfig(heartbeat_s=0.05, sync_timeout_s=30, inject="SIGSTOP:engine0.worker0:sync:1")
    previous = signal.signal(signal.SIGINT, sigint)  # background: what `job &` in a script hands its children
    started = time.monotonic()
    try:
        with pytest.raises(JobFault, match=r"engine 0 TP worker 0 .* is stopped .* during sync of step 1"):
            with Watchdog(cfg, runtime=None) as watchdog:
                with watchdog.phase("sync", 1):
                    _blocking_get()
    finally:
        signal.signal(signal.SIGINT, previous)
        worker.kill()
        worker.wait()
    # within a few heartbeats, not because the blocked get ran out (phase() raises the stored fault on any error)
    assert time.monotonic() - started < 5
    assert signal.getsignal(faults.INTERRUPT_SIGNAL) == signal.SIG_DFL  # put back
