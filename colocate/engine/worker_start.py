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
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.forkserver
import os

# What a TP worker imports before it works: the executor's worker loop (the process target), vLLM's CPU worker
# (its worker class, named in the config) and the worker extension; torch, transformers and vLLM come with them.
# This module too: the server unpickles each _WorkerProcess.
PRELOAD = ["vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker", "colocate.engine.extension",
           __name__]


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with its parent's environment as it was when start() was called."""

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
