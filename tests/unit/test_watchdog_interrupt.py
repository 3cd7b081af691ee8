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


def _stopped_worker_watchdog(monkeypatch, phase: str = "rollout"):
    worker = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(faults.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setattr(faults, "job_members", lambda runtime: [Member("engine 0 TP worker 0", worker.pid, (0,), "node",
                                                                       engine=0)])
    return worker, FaultConfig(heartbeat_s=0.05, inject=f"SIGSTOP:engine0.worker0:{phase}:1")


def test_a_deferred_fault_waits_for_the_engines_wait_and_never_cuts_the_state_change(monkeypatch):
    """fault.engine_restarts' rollout (job/engine_restarts.py): found while the pool changes (no wait on the
    engines), the fault is kept, not delivered; the next wait raises it at once, before anything blocks."""
    from colocate.errors import EngineFault

    worker, cfg = _stopped_worker_watchdog(monkeypatch)
    try:
        with Watchdog(cfg, runtime=None) as watchdog:
            with pytest.raises(EngineFault, match="is stopped") as raised:
                with watchdog.phase("rollout", 1), watchdog.deferring():
                    deadline = time.monotonic() + 1.0  # 20 heartbeats of "applying a pass": never interrupted
                    while time.monotonic() < deadline:
                        pass
                    assert isinstance(watchdog.fault, EngineFault) and watchdog.fault.engine == 0
                    with watchdog.waiting():
                        raise AssertionError("a kept fault is raised as the wait begins")
            assert raised.value is watchdog.fault
    finally:
        worker.kill()
        worker.wait()


def test_inside_a_deferred_phase_the_engines_wait_is_interrupted(monkeypatch):
    worker, cfg = _stopped_worker_watchdog(monkeypatch)
    started = time.monotonic()
    try:
        with pytest.raises(JobFault, match="is stopped"):
            with Watchdog(cfg, runtime=None) as watchdog:
                with watchdog.phase("rollout", 1), watchdog.deferring(), watchdog.waiting():
                    _blocking_get()
    finally:
        worker.kill()
        worker.wait()
    assert time.monotonic() - started < 5
