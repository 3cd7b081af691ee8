"""Rollouts run beside the controller's main thread. `Background`: one call, algo.mode=one_step_off's rollout of the
next step while this step trains. `ContinuousRollout`: algo.mode=async's passes, back to back, paused only for a
weight update.

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

import contextlib
import threading
import time
from collections.abc import Callable

from colocate.rollout.passes import Passes
from colocate.rl.samples import Group

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


class ContinuousRollout:
    """algo.mode=async: rollout passes run back to back in a thread of their own, each advancing every unfinished
    answer by rollout.partial_tokens tokens under the engines' current policy version. The main thread takes
    complete groups as a step needs them, and pauses the passes around a weight update.

        rollout = ContinuousRollout(rollouts, version=k)   # generating at once
        groups, stats = rollout.take(trained_version=k)     # waits for rollout.num_prompts complete groups
        ...                                                 # score, train: the passes go on
        rollout.pause()                                     # waits for the pass in flight to end
        ...                                                 # sync, checkpoint, evaluation: engines and pool idle
        rollout.resume(version=k + 1)                       # unfinished answers go on under the new weights
        rollout.close()

    Hazards, each why the class is written as it is:
    - One lock (a Condition) guards the pool and the prompt stream. The thread holds it to plan a pass and to
      apply its results, never across the engines' call; the main thread holds it to take. A take restarts too
      old answers of complete groups only: the pass in flight holds requests of the unfinished ones, and its
      results are applied to them as they were when it was planned.
    - An update never lands inside a pass: `pause` returns once the pass in flight has ended, and no pass starts
      until `resume`. The engines' prefix cache is reset at every sync, so no KV computed with old weights serves
      a token of the new version.
    - Every wait of the main thread is in short slices (see Background): the watchdog interrupts it to report a
      fault. The thread's error is raised by the main thread's next take or pause, inside a watched phase.
    - A daemon thread, never joined: a pass whose engine is lost with its node may never return.
    """

    def __init__(self, rollouts: Passes, *, version: int):
        self.rollouts = rollouts
        self._cond = threading.Condition()
        self._version = version
        self._paused = self._closed = self._in_pass = False
        self._error: BaseException | None = None
        self._pass_spans: list[tuple[float, float]] = []  # perf_counter (start, end) of the passes not yet drained
        self._thread = threading.Thread(target=self._run, daemon=True, name="colocate-async-rollout")
        self._thread.start()

    # ------------------------------------------------------------------------------------ the main thread

    def take(self, trained_version: int, num_groups: int | None = None) -> tuple[list[Group], dict]:
        """`num_groups` (default rollout.num_prompts) complete groups that policy `trained_version` may train
        (every token within rollout.max_lag of it), and the stats of the passes since the last take."""
        with self._cond:
            while True:
                self._raise_if_failed()
                taken = self.rollouts.take_complete(trained_version, num_groups)
                # wakes the thread: the places of the groups taken are free for new prompts, or the take
                # restarted too old answers of a full pool's complete groups
                self._cond.notify_all()
                if taken is not None:
                    return taken
                assert not self._paused, "a take while paused would wait forever"
                self._cond.wait(JOIN_SLICE_S)

    def pause(self) -> None:
        """Stop between two passes: on return no pass runs, and the engines and the pool are the caller's."""
        with self._cond:
            self._paused = True
            while self._in_pass:
                self._cond.wait(JOIN_SLICE_S)
            self._raise_if_failed()

    def resume(self, version: int) -> None:
        """Go on with the engines' policy `version` (the weights the sync just wrote)."""
        with self._cond:
            assert self._paused and not self._in_pass
            self._version, self._paused = version, False
            self._cond.notify_all()

    def hold(self) -> None:
        """rollout.update_in_pass: no new pass starts until `release`; the one in flight (if any) goes on, and the
        caller parks it in its engines (EngineActor.pause_pass)."""
        with self._cond:
            self._paused = True
            self._raise_if_failed()

    def release(self, version: int) -> None:
        """After an update inside the pass: the next passes are planned under policy `version`."""
        with self._cond:
            assert self._paused
            self._version, self._paused = version, False
            self._cond.notify_all()

    @contextlib.contextmanager
    def locked(self):
        """The pool as no pass's results change it (a checkpoint's reading while a pass is in flight)."""
        with self._cond:
            yield

    def drain_pass_spans(self) -> list[tuple[float, float]]:
        """The (start, end) of the passes that ended since the last drain: when the engines were busy."""
        with self._cond:
            spans, self._pass_spans = self._pass_spans, []
            return spans

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---------------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            while (work := self._next_pass()) is not None:
                started = time.perf_counter()
                outs = self.rollouts.run_pass(work)
                with self._cond:
                    ended = time.perf_counter()
                    self.rollouts.finish_pass(work, outs, ended - started)
                    self._pass_spans.append((started, ended))
                    self._in_pass = False
                    self._cond.notify_all()
        except BaseException as e:  # raised on the main thread by its next take or pause
            with self._cond:
                self._error, self._in_pass, self._closed = e, False, True
                self._cond.notify_all()

    def _next_pass(self):
        """Wait until a pass may run and has work (a step took groups, or answers are unfinished); None once
        closed."""
        with self._cond:
            while not self._closed:
                if not self._paused and (work := self.rollouts.start_pass(self._version)) is not None:
                    self._in_pass = True
                    return work
                self._cond.wait()
            return None
