"""A streamed rollout pass (rollout.stream): requests go into an engine's pass while it runs, and each result comes
out as its request finishes, not when the pass ends.

    stream = PassStream()                                 # the engine actor's, one per engine
    run_pass(llm, requests, ..., stream=stream)           # the pass thread: opens it, adds what is fed between steps
    stream.feed(more)                                     # the driver (EngineActor.stream_feed): False once closed
    results = stream.drain(wait_s=0.1)                    # the driver (EngineActor.stream_drain): finished so far

Every result leaves the engine exactly once: drained here as its request finished, or in the pass's return (the
requests the pass aborted when it ended, and any that finished as it ended). The driver, which keeps the requests
it sent (rollout/streaming.py), learns a request it fed did not run when the pass's return names neither it nor
its result: it is planned again from the pool, which that request never changed.

Hazards, each why the class is written as it is:
- The pass ends when it has nothing running and nothing fed (`close_if_idle`, one atomic look): a feed racing
  that end either lands before it (and the pass goes on) or is refused (and the driver keeps its requests for the
  engine's next pass). Never a request fed into a pass that has stopped looking.
- A pass that ends early (the rollout closing) closes the stream with requests still in its inbox: they are
  dropped, not run, and the driver plans them again.
- Only the driver's drain empties the outbox; a pass that starts keeps what the last one left there (the driver
  drains an engine once more after its pass has ended, so nothing is left behind).
- The driver's calls run in the actor's "stream" concurrency group: never behind a pass parked for a weight
  update (engine/pass_gate.py), whose sync's calls are the "control" group's.
"""

from __future__ import annotations

import threading


class PassStream:
    """Its inbox holds engine/requests.py EngineRequests, its outbox RequestResults (not imported: requests.py's
    run_pass takes a PassStream, and the modules must not import each other)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._open = False
        self._inbox: list = []
        self._outbox: list = []
        self._steps: list[tuple[float, int]] = []  # the engine steps since the last look: (seconds, sequences)
        self._decoded = [0, 0]  # and their requests that produced tokens, and those tokens

    # ------------------------------------------------------------------------------------------ the pass

    def open(self) -> None:
        with self._cond:
            assert not self._open, "two streamed passes at once on one engine"
            self._open, self._inbox = True, []

    def take_inbox(self) -> list:
        """The requests fed since the last look, for the pass to add before its next step."""
        with self._cond:
            fed, self._inbox = self._inbox, []
            return fed

    def finished(self, result) -> None:
        with self._cond:
            self._outbox.append(result)
            self._cond.notify_all()

    def stepped(self, busy: tuple[float, int], request_steps: int, tokens: int) -> None:
        """An engine step ran: (seconds since the pass started, sequences that produced a token in it)."""
        with self._cond:
            self._steps.append(busy)
            self._decoded[0] += request_steps
            self._decoded[1] += tokens

    def close_if_idle(self) -> bool:
        """The pass has nothing running: it ends unless something was fed meanwhile (then it must add that)."""
        with self._cond:
            if self._inbox:
                return False
            self._open = False
            return True

    def close(self) -> None:
        """The pass ends whatever was fed: what it had not added yet is dropped (the driver plans it again)."""
        with self._cond:
            self._open, self._inbox = False, []

    # ---------------------------------------------------------------------------------------- the driver

    def feed(self, requests: list) -> bool:
        """Into the pass in flight; False when none is open (the requests are the driver's again)."""
        with self._cond:
            if not self._open:
                return False
            self._inbox += requests
            return True

    def drain(self, wait_s: float = 0.0) -> list:
        """The results finished since the last drain; waits up to `wait_s` for a first one."""
        with self._cond:
            if not self._outbox and wait_s > 0:
                self._cond.wait(wait_s)
            out, self._outbox = self._outbox, []
            return out

    def progress(self) -> tuple[list[tuple[float, int]], list[int]]:
        """The engine steps since the last look (the busy timeline a pass returns, in pieces) and their decode
        counters; each step is reported once."""
        with self._cond:
            steps, self._steps = self._steps, []
            decoded, self._decoded = self._decoded, [0, 0]
            return steps, decoded

    @property
    def is_open(self) -> bool:
        return self._open
