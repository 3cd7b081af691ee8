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
from colocate.job.faults import Watchdog
from colocate.job.members import Member


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


def test_an_engine_whose_pass_stops_stepping_is_named_by_its_heartbeat(monkeypatch):
    """fault.engine_timeout_s: every process alive and running, but the engine's pass has made no engine step for
    longer than the bound (a hung worker or device call). Its probe (EngineActor.stalled_s, the pass gate's
    heartbeat, answered from the probe thread) says how long; the engine is named as an EngineFault, which
    fault.engine_restarts recovers. Ray's calls are the boundary stood in for here."""
    from colocate.engine.pass_gate import PassGate
    from colocate.errors import EngineFault

    gate = PassGate()
    assert gate.stalled_s() is None  # no pass: nothing to be late for
    with gate.running(0):
        time.sleep(0.05)
        assert gate.stalled_s() >= 0.05
        gate.stepped_at = time.monotonic()  # a step (engine/requests.py run_pass)
        assert gate.stalled_s() < 0.05
    actor = subprocess.Popen(["sleep", "60"])  # alive, never stopped: only the heartbeat can find it
    monkeypatch.setattr(faults.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setattr(faults, "job_members", lambda runtime: [Member("engine 0", actor.pid, (1,), "node", "a0",
                                                                       engine=0)])
    stalled = {"engine 0": 0.5}
    engine = SimpleNamespace(stalled_s=SimpleNamespace(remote=lambda: "engine 0"))
    monkeypatch.setattr(faults.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(faults.ray, "get", lambda ref: stalled[ref])
    cfg = FaultConfig(heartbeat_s=0.05, engine_timeout_s=2.0)
    try:
        with Watchdog(cfg, runtime=SimpleNamespace(engines=[engine])) as watchdog:
            with watchdog.phase("rollout", 1):
                time.sleep(0.5)  # stepping: under the bound, nothing found
            with pytest.raises(EngineFault, match=r"engine 0 \(slot 1, this node, pid \d+\) made no engine step for "
                                                  r"9.0 s during rollout of step 1 \(fault.engine_timeout_s=2\)"):
                with watchdog.phase("rollout", 1):
                    stalled["engine 0"] = 9.0
                    _blocking_get()
    finally:
        actor.kill()
        actor.wait()
