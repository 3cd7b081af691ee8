"""One call run beside the controller's main thread: algo.mode=one_step_off's rollout of the next step, while
this step trains.

    ahead = Background(rollouts.generate, step, trained_version=step + 1)   # starts at once
    ...                                                                     # train on the main thread
    ahead.wait()                                                            # its result, or its error, raised here

Hazards, each why the class is written as it is:
- A daemon thread, not a ThreadPoolExecutor: the executor's workers are joined at interpreter exit, so a rollout
  whose `ray.get` never returns (an engine lost with its node) would keep a failed job from exiting.
- `wait` waits in short slices: the watchdog reports a fault by interrupting the main thread
  (_thread.interrupt_main), which Python delivers only between bytecodes; one long wait would sit on its lock
  and never see it. On an event, not `Thread.join`: CPython 3.11's join, interrupted, releases the running
  thread's state lock and marks it stopped (threading._wait_for_tstate_lock), so it would look done.
- The call's exception is re-raised by `wait`, on the main thread, inside the controller's watched phase: there
  the watchdog maps a Ray error to the member behind it, as for any phase.
- The call must touch only what the main thread leaves alone until `wait` returns (the rollout pool and the
  engines, here: the trainer and the sync use neither).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

JOIN_SLICE_S = 0.2  # how often a waiting main thread gets to run a pending signal handler


class Background:
    def __init__(self, fn: Callable, *args, **kwargs):
        self._result = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None  # perf_counter seconds, set as the call returns or raises
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                                        name=f"colocate-{getattr(fn, '__name__', 'call')}")
        self._thread.start()

    def _run(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        try:
            self._result = fn(*args, **kwargs)
        except BaseException as e:  # handed to the main thread by wait(), which raises it there
            self._error = e
        finally:
            self.finished_at = time.perf_counter()
            self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self):
        while not self._finished.wait(JOIN_SLICE_S):
            pass
        if self._error is not None:
            raise self._error
        return self._result
