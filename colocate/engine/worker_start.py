"""vLLM's TP worker processes on the CPU, forked from a server that imported their code once.

On the CPU an engine with TP > 1 runs vLLM's multiprocessing executor (on CUDA its Ray executor, whose workers
are Ray actors), which spawns each TP worker: a new interpreter that imports torch, vLLM's CPU worker and our
worker extension before it does anything. Measured on our 2-core machines, a TP worker's start is about 14
CPU-s, three quarters of it those imports, and every engine start pays it once per worker (a job's restarts
too), while its two workers import the very same modules side by side.

Here the workers come from Python's forkserver instead: its server process is a fresh interpreter that imports
those modules once, while the engine prepares (beside the trainers' load), and each worker is forked from that
state. One import per engine instead of one per worker; a worker then starts with no import of its own.

Why not fork the workers from the engine actor itself (vLLM's default outside Ray): the actor is a Ray worker
with Ray's threads (gRPC, the core worker), and vLLM refuses to fork in a Ray actor
(vllm/utils/system_utils.py `_maybe_force_spawn`). The server has one thread, and only imports.

Hazards:
- A forked child inherits the server's environment, where a spawned one gets its parent's at the moment it
  starts. vLLM sets per-rank variables around each worker's start (vllm/utils/ompmultiprocessing.py
  `configure_omp_envs`), so each process object carries the environment of its start and the child applies it
  first. What is read at import stays the server's, which is why it starts after engine_env is applied: libgomp
  reads OMP_NUM_THREADS when torch loads.
- The server must import and never compute: libgomp's thread pool, made by the first parallel op, does not
  survive a fork, and the server's one thread is what makes forking it safe.
- The workers are the server's children, not the actor's: the server reaps them and reports each exit code
  (a signal as its negative, as with spawn) through the process object's sentinel, which the actor watches
  (engine/actor.py `_watch_workers`). The server exits with the actor (its alive pipe closes).
- That status is 4 bytes on a pipe, readable once, and two threads ask for it: the actor's watcher and vLLM's
  worker monitor (vllm 0.32 v1/executor/multiproc_executor.py `monitor_workers`, which reads `proc.exitcode`
  as soon as the sentinel is ready, then `_ensure_worker_termination`'s `is_alive()`). CPython's forkserver
  Popen.poll (3.11 multiprocessing/popen_forkserver.py) reads with no lock: the thread that loses finds the pipe
  at its end and stores 255 ("perhaps the forkserver process itself got killed") over the code the other read;
  one that comes between the read and the server's close sees no status yet (None). Seen in CI with a second
  test file running beside: a SIGKILLed worker named "exited with code 255". _StatusPopen reads it once.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import os
import threading
from multiprocessing.connection import wait

# What a TP worker imports before it works: the executor's worker loop (the process target), vLLM's CPU worker
# (its worker class, named in the config) and the worker extension; torch, transformers and vLLM come with them.
# This module too: the server unpickles each _WorkerProcess.
PRELOAD = ["vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker", "colocate.engine.extension",
           __name__]


class _StatusPopen(multiprocessing.popen_forkserver.Popen):
    """The forkserver's Popen whose exit status is read from the sentinel by one thread only, and kept: every
    caller, in any thread, gets the code the server wrote (see the module's hazards)."""

    def __init__(self, process_obj):
        self._status_lock = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None and flag != os.WNOHANG:
            wait([self.sentinel])  # a blocking poll (join) waits outside the lock: is_alive() stays free
        with self._status_lock:  # the readiness check too: the status is read and stored as one step
            if self.returncode is None and wait([self.sentinel], 0):
                try:
                    self.returncode = multiprocessing.forkserver.read_signed(self.sentinel)
                except (OSError, EOFError):  # the server closed the pipe with no status: it died
                    self.returncode = 255
            return self.returncode


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with its parent's environment as it was when start() was called."""

    @staticmethod
    def _Popen(process_obj):
        return _StatusPopen(process_obj)

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _WorkerContext(multiprocessing.context.ForkServerContext):
    Process = _WorkerProcess


def start_worker_server() -> None:
    """Make vLLM's multiprocessing executor start its workers from a preloaded forkserver, and start that
    server now, so that its imports run while the trainers load. Call after the engine's environment is set
    (engine_env, umask, VLLM_RPC_BASE_PATH): the server and every worker inherit what it is now."""
    context = _WorkerContext()
    context.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    from vllm.v1.executor import multiproc_executor

    # the executor calls get_mp_context() for its workers' processes, pipes and lock (vllm 0.32,
    # v1/executor/multiproc_executor.py); the name it imported is the one to replace
    multiproc_executor.get_mp_context = lambda: context
