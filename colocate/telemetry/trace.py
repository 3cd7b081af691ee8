"""What a run did, in order: the switching events, each phase's span, and the current step's phase times. The
controller and the rollout modes (colocate/rollout/modes.py) write into the one trace, so a mode that waits
for its engines times that wait as a phase of the step without reaching back into the controller.

    trace = Trace()
    times = trace.new_step()                   # the step's {phase: seconds}; the three switches of a step add up
    with trace.phase("train", step):           # watched: a member that dies or hangs in it becomes a JobFault
        ...
    trace.event("trainer.offload")             # the switching order as it happened (tests assert it)
    with trace.phase("metrics", step, timed=False):   # watched, spanned, not one of the step's times

Bounded: a run of days must not grow with its steps (the soak bench measured ~9 KiB per step when every record
stayed); metrics.jsonl keeps them all.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

HISTORY_KEPT = 1000  # the newest step records a controller keeps; spans: ten a step


class Trace:
    def __init__(self):
        self.events: deque[str] = deque(maxlen=10_000)
        # (phase, step, start, end) in perf_counter seconds, the newest phases: `bench async`'s timeline
        self.spans: deque[tuple[str, int | None, float, float]] = deque(maxlen=HISTORY_KEPT * 10)
        self.times: dict[str, float] = {}
        self.watchdog = None  # job/faults.py's Watchdog while a run is watched; a test's step() alone is not

    def new_step(self) -> dict[str, float]:
        self.times = {}
        return self.times

    def event(self, name: str) -> None:
        self.events.append(name)

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None, *, timed: bool = True):
        """The block's wall time added to the step's times[name] (unless not `timed`: before the first step, or
        the step's metrics), under the watchdog's eye."""
        started = time.perf_counter()
        try:
            with self.watchdog.phase(name, step) if self.watchdog else contextlib.nullcontext():
                yield
        finally:
            ended = time.perf_counter()
            if timed:
                self.times[name] = self.times.get(name, 0.0) + ended - started
            self.spans.append((name, step, started, ended))
