"""A weight update inside a rollout pass: the engine's pass stops between two engine steps, the sync rewrites the
weights, and the pass goes on under the new policy. Each token is tagged with the version of the weights that
sampled it.

    gate = PassGate()
    run_pass(llm, requests, ..., gate=gate, version=k)   # the pass thread: every engine touch inside gate.work()
    gate.pause()                                        # a control thread: returns between two engine steps
    ... sync ...                                        # the engine is the control thread's until resume
    gate.resume(k + 1)                                  # the pass samples its next tokens with version k + 1

EngineActor.run_pass runs in the actor's default thread; pause, the sync's calls and resume in its "control"
concurrency group (a thread of their own), which is why the engine's two users are kept apart here and not by
Ray's one-call-at-a-time.

vLLM has the same feature for its async front end (vLLM 0.32 `AsyncLLM.pause_generation(mode="keep",
clear_cache=False)`, v1/engine/async_llm.py: requests frozen in the scheduler until `resume_generation`). colocate
drives `LLMEngine.step` itself (engine/requests.py), so not calling it is the pause: no scheduler state changes,
and the pause lands after whichever step is running, about one decode step later.

What happens to the KV cache of the answers in flight (rollout.update_in_pass):
- keep: their KV stays as the old weights computed it; the tokens after the update attend to it (PipelineRL's
  and AReaL's in-flight updates do the same). The prefix cache cannot be reset while those requests hold blocks,
  so the engine resets it when the pass ends: a later pass never reads a prefix the old weights computed.
- recompute: vLLM preempts every running request and frees its blocks (`reset_prefix_cache(
  reset_running_requests=True)`, v1/core/sched/scheduler.py), so each is prefilled again over its prompt and its
  tokens so far with the new weights before it samples another. Exact, at the price of one prefill per answer.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

WAIT_SLICE_S = 0.2  # how often a parked pass, or a pause waiting for a step, looks again


class PassGate:
    def __init__(self):
        self._cond = threading.Condition()
        self._held = False  # an update wants the engine: the pass parks at its next boundary
        self._busy = False  # the pass is inside work(): adding requests, stepping or aborting
        self._in_pass = False
        self.version: int | None = None  # the policy version of the weights the pass in flight samples with
        self._pending: int | None = None  # an update that found no pass in flight: the next pass's, if newer
        self._end_next = False  # the rollout ended with no pass in flight: one that starts now ends at once
        self.added = False  # the pass in flight has added its requests to the engine
        self.updated_in_pass = False  # an update landed inside the pass in flight (keep: reset its cache after)
        self.parked_s = 0.0  # the pass in flight's seconds parked for updates
        self.ending = False  # the pass in flight must end at its next boundary (the rollout is closing)
        self.steps = 0  # the pass in flight's engine steps so far
        self.stepped_at = 0.0  # when it last stepped (or began): time.monotonic()
        self.request_steps = self.tokens = 0  # its requests' steps that produced tokens, and those tokens: more
        # tokens than steps when speculative decoding's drafts are accepted (rollout.speculative)

    # ------------------------------------------------------------------------------------------ the pass

    def stalled_s(self) -> float | None:
        """Seconds since the pass in flight last stepped (or began): its heartbeat (fault.engine_timeout_s); None
        with no pass in flight, or one parked for a weight update (its wait is the update's)."""
        with self._cond:
            if not self._in_pass or self._held:
                return None
            return time.monotonic() - self.stepped_at

    @contextmanager
    def running(self, version: int):
        """A pass planned under policy `version`. The engine may hold a newer one already: an update can land
        between the pass's planning (the driver's thread) and its start here, and is then this pass's."""
        with self._cond:
            assert not self._in_pass, "two passes at once on one engine"
            self._in_pass, self.updated_in_pass, self.parked_s, self.added = True, False, 0.0, False
            self.steps = self.request_steps = self.tokens = 0
            self.stepped_at = time.monotonic()
            self.ending, self._end_next = self._end_next, False  # a rollout that ended before this pass started
            self.version = version if self._pending is None else max(version, self._pending)
            self._pending = None
        try:
            yield self
        finally:
            with self._cond:
                self._in_pass = False
                self._cond.notify_all()

    @contextmanager
    def work(self):
        """The pass touches the engine: waits while an update holds it."""
        with self._cond:
            if self._held:
                parked = time.perf_counter()
                while self._held:
                    self._cond.wait(WAIT_SLICE_S)
                self.parked_s += time.perf_counter() - parked
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    # ----------------------------------------------------------------------------------- the control thread

    def pause(self) -> bool:
        """Hold the engine for an update: returns once no pass touches it (a pass in flight is parked between two
        engine steps, and no pass starts until resume). Returns whether a pass is in flight."""
        with self._cond:
            self._held = True
            while self._busy:
                self._cond.wait(WAIT_SLICE_S)
            return self._in_pass

    def resume(self, version: int, *, end: bool = False, stale_cache: bool = True) -> None:
        """The engine holds policy `version` now; a parked pass goes on with it. `end`: the pass in flight aborts
        what is unfinished at its next boundary and returns (its results keep their tokens for a continuation); a
        pass that starts only after it ends at once. `stale_cache`: the pass's requests hold KV blocks the old
        weights computed (keep), so the prefix cache is reset when the pass ends; False after recompute's reset."""
        with self._cond:
            assert self._held, "resume without pause"
            if self._in_pass:
                if self.added:  # its requests hold blocks (a pass parked before adding them holds none)
                    self.updated_in_pass = stale_cache
                self.ending = self.ending or end
            elif end:  # a pass planned before the rollout's end may reach the engine only now
                self._end_next = True
            else:  # a pass planned before the update may start only now: it is the update's
                self._pending = version
            self.version, self._held = version, False
            self._cond.notify_all()

    @property
    def holds_blocks(self) -> bool:
        """A pass is in flight and has added its requests: they hold KV blocks, so the prefix cache cannot be reset
        until it ends."""
        return self._in_pass and self.added

    @contextmanager
    def exclusive(self):
        """The engine for a call of the control thread that is not an update (a memory reading, a sync outside
        rollout.update_in_pass): a pass in flight parks for its length. Inside an update's hold it is that hold."""
        with self._cond:
            outer = self._held
        if outer:
            yield
            return
        self.pause()
        try:
            yield
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    @property
    def held(self) -> bool:
        return self._held

    @property
    def in_pass(self) -> bool:
        return self._in_pass
