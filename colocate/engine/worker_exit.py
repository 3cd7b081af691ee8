"""A vLLM TP worker process (vLLM's multiprocessing executor) that has shut down cleanly exits at once, without
the interpreter's finalization.

Measured on the CPU build (2 cores): a worker's own shutdown (queues, process groups) takes ~0.6 s after the
engine asks for it, then the interpreter takes another ~2.6 s to tear down the modules of torch and vLLM it
imported, while the engine's shutdown waits for the process to be gone (vLLM 0.32
`MultiprocExecutor._ensure_worker_termination` polls until it is, 5 s at most before SIGTERM). Every engine a
job stops (its end, a restart, a test) paid those 2.6 s for nothing any other process reads.

What runs, in the order the interpreter would run it (CPython's Py_FinalizeEx: wait for non-daemon threads, then
the atexit callbacks): multiprocessing's own exit function (where `BaseProcess._bootstrap` calls it, with the same
result), then `threading._shutdown`, the atexit callbacks, the standard streams flushed, then `os._exit(0)`: 0 is
the code `_bootstrap` returns for a `run()` that returned. Only a worker whose `run()` returned takes this path:
one leaving with an exception (a SIGTERM's SystemExit included) goes on as before and keeps its exit code, which
the watchdog reads (job/faults.py).

Hazard: `sys.exc_info()` tells the two apart: `_bootstrap` calls `util._exit_function` in a `finally`, where it is
the exception in flight, if any (CPython 3.11). Only processes vLLM's executor started are changed: the wrapper
is installed where the worker extension is imported, and acts only in a multiprocessing child.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import os
import sys
import threading


def exit_without_finalization() -> None:
    """Install the fast exit in this process, if it is a multiprocessing child (a vLLM TP worker). Idempotent."""
    if multiprocessing.parent_process() is None or getattr(multiprocessing.util._exit_function, "_colocate", False):
        return
    original = multiprocessing.util._exit_function

    def _exit_function(*args, **kwargs):
        original(*args, **kwargs)
        if sys.exc_info()[0] is not None:  # run() raised: the usual way out, with its exit code
            return
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(0)

    _exit_function._colocate = True
    multiprocessing.util._exit_function = _exit_function
