"""The forkserver context vLLM's TP workers start from on the CPU (colocate/engine/worker_start.py): a worker sees
its parent's environment as it was at the worker's start (vLLM sets per-rank variables around each start), it
is the server's child with the server's imports, and its exit code (a signal's included) reaches the parent as a
spawned worker's does, however many threads ask for it at once. In a subprocess: the forkserver is one per
process, and the pytest process keeps its own (tests/distributed/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, multiprocessing.connection, multiprocessing.forkserver, os, signal, threading, time
from colocate.engine.worker_start import _WorkerContext
from tests.unit.test_worker_start import probe, sleep_forever

context = _WorkerContext()
context.set_forkserver_preload(["colocate.engine.worker_start", "tests.unit.test_worker_start"])
multiprocessing.forkserver.ensure_running()
results = []
for rank in range(2):
    os.environ["COLOCATE_TEST_RANK"] = str(rank)  # set after the server started, as vLLM sets them
    queue = context.SimpleQueue()
    p = context.Process(target=probe, args=(queue,))
    p.start()
    results.append({**queue.get(), "pid": p.pid})
    p.join()
    results[-1]["exitcode"] = p.exitcode
del os.environ["COLOCATE_TEST_RANK"]
killed = context.Process(target=sleep_forever)
killed.start()
os.kill(killed.pid, signal.SIGKILL)
killed.join()
# The status as the engine actor's watcher and vLLM's worker monitor read it: threads at once, right after the
# sentinel is ready (unguarded, 12 of 30 such rounds gave 255 or None to some reader, and to the process).
concurrent = []
for _ in range(20):
    p = context.Process(target=sleep_forever)
    p.start()
    os.kill(p.pid, signal.SIGKILL)
    multiprocessing.connection.wait([p.sentinel])
    time.sleep(0.02)  # the server has written the status and closed the pipe: a late reader finds its end
    barrier, seen = threading.Barrier(8), []
    readers = [threading.Thread(target=lambda: (barrier.wait(), seen.append(p.exitcode))) for _ in range(8)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    concurrent.append(sorted(set(seen + [p.exitcode])))
print(json.dumps({"workers": results, "killed": killed.exitcode, "parent": os.getpid(), "concurrent": concurrent}))
"""


def probe(queue) -> None:
    import sys

    queue.put({"rank": os.environ.get("COLOCATE_TEST_RANK"), "ppid": os.getppid(),
               "preloaded": "tests.unit.test_worker_start" in sys.modules})


def sleep_forever() -> None:
    import time

    time.sleep(600)


def test_workers_start_with_their_own_environment_from_the_server_and_report_exits():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    workers = out["workers"]
    assert [w["rank"] for w in workers] == ["0", "1"]  # each its own start's, not the server's (it had none)
    assert all(w["exitcode"] == 0 and w["preloaded"] for w in workers)
    # forked by the server, not by the process that asked: one server for both, neither the parent itself
    assert workers[0]["ppid"] == workers[1]["ppid"] != out["parent"]
    assert out["killed"] == -9  # as a spawned process's: the watchdog and vLLM read the signal from it
    assert out["concurrent"] == [[-9]] * 20  # every reader, and the process after them, got the signal


def test_an_eager_cpu_engine_runs_without_torch_compile():
    """vLLM wraps three small ops in torch.compile even in eager mode; an eager CPU engine runs them eagerly (its
    processes would otherwise trace and compile them at their first step). A compiled or CUDA engine is left as
    vLLM sets it."""
    from colocate.config import EngineConfig
    from colocate.engine.actor import engine_env

    assert engine_env(EngineConfig(enforce_eager="true"), "cpu")["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in engine_env(EngineConfig(enforce_eager="false"), "cpu")
    assert "TORCH_COMPILE_DISABLE" not in engine_env(EngineConfig(enforce_eager="true"), "cuda")
