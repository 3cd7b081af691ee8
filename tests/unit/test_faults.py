"""The watchdog's reading of processes and exit codes (colocate/job/faults.py); the faults themselves, injected into
real jobs, are tests/e2e/test_faults.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from colocate.job.faults import process_state, recorded_deaths, signal_name
from colocate.job.injections import parse_injection
from colocate.job.members import Member


def test_exit_codes_read_as_causes():
    assert signal_name(-9) == "killed by SIGKILL"
    assert signal_name(-15) == "killed by SIGTERM"
    assert signal_name(3) == "exited with code 3"
    assert signal_name(None) == "gone (exit status unknown)"


def _wait_for(pid: int, states: set, timeout_s: float = 10):
    deadline = time.monotonic() + timeout_s
    while process_state(pid) not in states:
        assert time.monotonic() < deadline, f"pid {pid} stayed {process_state(pid)!r}"
        time.sleep(0.02)
    return process_state(pid)


def test_process_states_the_watchdog_acts_on():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _wait_for(child.pid, {"S", "R"}) in {"S", "R"}
        os.kill(child.pid, signal.SIGSTOP)
        assert _wait_for(child.pid, {"T"}) == "T"  # stopped: alive, never answering
        os.kill(child.pid, signal.SIGKILL)
        assert _wait_for(child.pid, {"Z"}) == "Z"  # dead, not yet reaped by its parent
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None  # reaped: gone


def test_members_are_described_with_slots_and_node():
    worker = Member("engine 0 TP worker 1", 4242, (1,), "3f2a9c01aa", engine=0)
    engine = Member("engine 0", 4240, (0, 1), "77aa00bb11", actor_id="ab", engine=0)
    assert worker.describe("3f2a9c01aa") == "engine 0 TP worker 1 (slot 1, this node, pid 4242)"
    assert engine.describe("3f2a9c01aa") == "engine 0 (slots 0-1, node 77aa00bb, pid 4240)"


@pytest.mark.parametrize("spec, member", [("SIGKILL:engine0.worker1:rollout:2", "engine 0 TP worker 1"),
                                          ("kill:trainer1:train:1", "trainer rank 1"),
                                          ("STOP:engine2:sync:0", "engine 2")])
def test_injections_name_members_as_the_watchdog_does(spec, member):
    assert parse_injection(spec).member == member


def test_a_checkpoint_save_has_its_own_bound_and_its_fault_names_it():
    from colocate.config import FaultConfig
    from colocate.job.faults import Watchdog

    watchdog = Watchdog.__new__(Watchdog)  # the deadlines only: no Ray, no members
    watchdog.cfg, watchdog.members, watchdog.local_node = FaultConfig(checkpoint_timeout_s=3600), [], "node"
    assert watchdog.timeout_s("checkpoint") == 3600
    assert watchdog.timeout_s("sync") == watchdog.timeout_s("switch") == 600
    assert "within 3600 s (fault.checkpoint_timeout_s)" in str(watchdog._overdue("checkpoint", 20))
    assert "(fault.sync_timeout_s)" in str(watchdog._overdue("switch", 20))


class _EngineActor:
    """The engine actor's worker_deaths() as the watchdog meets it (the boundary: a Ray actor): answers queued
    calls in order; the first `empty` answers hold no exit yet (its recorder had not seen it), or it is gone."""

    def __init__(self, empty: int, gone: bool = False):
        self.empty, self.gone, self.calls = empty, gone, 0

    def call(self) -> int:
        self.calls += 1
        return self.calls

    def get(self, ref: int, timeout: float) -> list:
        assert timeout > 0 and ref == self.calls  # one call in the actor's queue at a time: the newest
        if self.gone:
            raise RuntimeError("The actor died unexpectedly before finishing this task.")
        return [] if ref <= self.empty else [(1, 4242, -9)]


def test_a_dead_workers_record_is_awaited_and_any_other_answer_taken_as_it_is():
    actor = _EngineActor(empty=2)  # seen dead before its engine recorded it: the next answers hold the exit
    assert recorded_deaths(actor.call, actor.get, wait_s=30, until_one=True, poll_s=0.01) == [(1, 4242, -9)]
    assert actor.calls == 3
    actor = _EngineActor(empty=2)  # an engine's error of another kind: its first answer, empty, stands
    assert recorded_deaths(actor.call, actor.get, wait_s=30, until_one=False) == [] and actor.calls == 1
    actor = _EngineActor(empty=0, gone=True)  # the engine actor itself is gone: nothing recorded to read
    assert recorded_deaths(actor.call, actor.get, wait_s=30, until_one=True) == []
    actor = _EngineActor(empty=10 ** 9)  # never records: the wait ends
    assert recorded_deaths(actor.call, actor.get, wait_s=0.2, until_one=True, poll_s=0.01) == []
