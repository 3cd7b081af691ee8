"""The session-end half of the e2e leak check (tests/e2e/conftest.py): the semaphores a test could not tell from
another run's are checked once every other run's processes are gone. Under xdist each worker checks its own
and reports what is left to the controller (xdist's workeroutput), which fails the session."""

from __future__ import annotations

import sys
import time

import pytest

LEFT = "semaphores_left"
_reported: list[str] = []


def _check_deferred(timeout_s: float = 300) -> tuple[list[str], str | None]:
    """The deferred semaphores still there once no other run has a process left, or why none were checked."""
    e2e = sys.modules.get("tests.e2e.conftest")
    if e2e is None or not e2e.DEFERRED_SEMAPHORES:
        return [], None
    deadline = time.monotonic() + timeout_s
    while e2e.other_runs_alive():
        if time.monotonic() > deadline:
            return [], f"{len(e2e.DEFERRED_SEMAPHORES)} deferred semaphore(s) not checked: another run still alive"
        time.sleep(2)
    time.sleep(5)  # the last exits' resource trackers unlink what their processes named
    live = e2e.shm_segments()
    return sorted(name for name in e2e.DEFERRED_SEMAPHORES if name in live), None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    left, why = _check_deferred()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        workeroutput[LEFT] = left
        workeroutput[LEFT + "_why"] = why
        return
    left += _reported
    if why:
        print(f"\n{why}", file=sys.stderr)
    if left:
        print(f"\nshared-memory semaphores left behind by the e2e tests: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: what a worker found left at its end."""
    _reported.extend(node.workeroutput.get(LEFT, []))
    if node.workeroutput.get(LEFT + "_why"):
        print(f"\n{node.gateway.id}: {node.workeroutput[LEFT + '_why']}", file=sys.stderr)
