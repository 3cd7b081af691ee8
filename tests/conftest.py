"""The session-end half of the e2e leak check (tests/e2e/conftest.py): the semaphores a test could not tell from
another run's are checked once every other run's processes are gone. Under xdist each worker checks its own
and reports what is left to the controller (xdist's workeroutput), which fails the session."""

from __future__ import annotations

import sys
import time

import pytest

from colocate.host.shm import mapped_by

# Seconds each slow file takes in a whole-suite run on two workers (2 cores, AVX-512 AMD EPYC, the b1cab24 run).
# `make test` hands files out in this order, heaviest first (xdist's loadfile with --no-loadscope-reorder keeps
# the collection's order; its default orders files by their number of tests, which put the one-test end-to-end
# files last, where one worker ran them alone for minutes while the other had nothing left). Unlisted files
# weigh by their directory.
FILE_SECONDS = {
    "tests/e2e/test_faults.py": 325, "tests/e2e/test_failures.py": 232, "tests/e2e/test_resume.py": 136,
    "tests/e2e/test_algorithms.py": 133, "tests/e2e/test_reward_model.py": 126, "tests/e2e/test_runtime.py": 121,
    "tests/e2e/test_architectures.py": 120, "tests/e2e/test_multinode.py": 140, "tests/e2e/test_cluster.py": 112,
    "tests/e2e/test_split.py": 310, "tests/e2e/test_gpu_placement.py": 83, "tests/e2e/test_lora.py": 104,
    "tests/e2e/test_isolation.py": 78, "tests/e2e/test_long_answers.py": 77, "tests/e2e/test_jobs.py": 61,
    "tests/distributed/test_bench_train.py": 58, "tests/e2e/test_rollout.py": 80, "tests/e2e/test_soak_bench.py": 47,
    "tests/e2e/test_calculator.py": 47, "tests/e2e/test_gather_job.py": 46, "tests/e2e/test_multiturn.py": 46,
    "tests/e2e/test_router_replay.py": 60,
    "tests/e2e/test_moe.py": 41, "tests/e2e/test_fp32_engine.py": 31, "tests/distributed/test_trainer.py": 30,
    "tests/e2e/test_env_workers.py": 24,
    "tests/unit/test_gpu_check.py": 30,  # one run of scripts/gpu_check.py --device cpu (25-50 s by the load)
}
DIRECTORY_SECONDS = {"e2e": 120, "distributed": 30}


def pytest_collection_modifyitems(session, config, items):
    def seconds(item) -> float:
        path = item.nodeid.split("::")[0]
        return FILE_SECONDS.get(path, DIRECTORY_SECONDS.get(path.split("/")[1] if "/" in path else "", 1))

    items.sort(key=seconds, reverse=True)  # stable: a file's tests stay together and in order


LEFT = "semaphores_left"
_reported: list[str] = []
_notes: list[str] = []


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
    left = e2e.DEFERRED_SEMAPHORES.keys() & e2e.shm_segments()
    # one a living process maps (by inode, as the product's cleanup judges it) is not left behind: e.g. a
    # multiprocessing lock the other xdist worker holds in its own pytest process, which carries no run tag
    return sorted(f"{name} (new after {e2e.DEFERRED_SEMAPHORES[name]})" for name in left - mapped_by(left)), None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    left, why = _check_deferred()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        workeroutput[LEFT] = left
        workeroutput[LEFT + "_why"] = why
        return
    _reported.extend(left)
    if why:
        _notes.append(why)
    if _reported:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: what a worker found left at its end."""
    _reported.extend(node.workeroutput.get(LEFT, []))
    if node.workeroutput.get(LEFT + "_why"):
        _notes.append(f"{node.gateway.id}: {node.workeroutput[LEFT + '_why']}")


def pytest_terminal_summary(terminalreporter):
    """Beside the final counts, where a CI log's tail shows it: passed tests and a failed session otherwise."""
    for note in _notes:
        terminalreporter.write_line(note)
    if _reported:
        terminalreporter.write_line("FAILED: shared-memory semaphores left behind by the e2e tests: "
                                    f"{sorted(_reported)}", red=True)
