"""The forkserver context vLLM's TP workers start from on the CPU (colocate/engine/worker_start.py): a worker sees
its parent's environment as it was at the worker's start (vLLM sets per-rank variables around each start), it
is the server's child with the server's imports, and its exit code (a signal's included) reaches the parent as a
spawned worker's does. In a subprocess: the forkserver is one per process, and the pytest process keeps its own
(tests/distributed/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, multiprocessing.forkserver, os, signal
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
print(json.dumps({"workers": results, "killed": killed.exitcode, "parent": os.getpid()}))
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


def test_an_eager_cpu_engine_runs_without_torch_compile():
    """vLLM wraps three small ops in torch.compile even in eager mode; an eager CPU engine runs them eagerly (its
    processes would otherwise trace and compile them at their first step). A compiled or CUDA engine is left as
    vLLM sets it."""
    from colocate.config import EngineConfig
    from colocate.engine.actor import engine_env

    assert engine_env(EngineConfig(enforce_eager="true"), "cpu")["TORCH_COMPILE_DISABLE"] == "1"
    assert "TORCH_COMPILE_DISABLE" not in engine_env(EngineConfig(enforce_eager="false"), "cpu")
    assert "TORCH_COMPILE_DISABLE" not in engine_env(EngineConfig(enforce_eager="true"), "cuda")
