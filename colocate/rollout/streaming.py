"""algo.mode=async with rollout.stream: the rollout as a stream. Each engine runs a pass that takes new requests
while it runs (engine/stream.py); every answer's result comes back as it finishes, so a group is complete, and a
step may take it, the moment its last answer ends, not when a pass ends. New prompts go into the places of the
groups a step took, and an answer's next segment (rollout.partial_tokens) or turn (rollout.env) is fed as soon as
its last one is back: the engines wait for the trainer only where the pool holds nothing but complete groups.

    rollout = StreamingRollout(rollouts, version=k)    # ContinuousRollout's face: take, hold, release, pause, close
    groups, stats = rollout.take(trained_version=k)      # returns once enough groups are complete, mid-pass

Weight updates enter the passes in flight (rollout.update_in_pass, engine/pass_gate.py): a streamed pass ends only
when its engine runs dry, so without them an update would wait for that (config/schema.py refuses the pair).
While held for an update the thread feeds nothing and starts no pass, but goes on taking results back (the parked
passes finish none until the update is in).

Hazards, each why the class is written as it is:
- The thread keeps every request it sent until its result is back or its engine's pass has ended: a request of
  an answer in flight is never planned twice, and its answer is never restarted under it (Passes.stream_requests
  skips both). A pass's end frees the requests it never added (fed as it ended): the pool still plans them.
- An engine is drained once more after its pass has ended (the wait that saw it end comes first): its results
  leave either through the stream or in the pass's return, never both (engine/stream.py), and none is left.
- Everything that changes the pool runs under the lock; the engines' calls run outside it, so a take never
  waits for an engine step, only for a result.
"""

from __future__ import annotations

import time

import ray

from colocate.engine.requests import EngineRequest
from colocate.rollout.overlap import JOIN_SLICE_S, ContinuousRollout
from colocate.rollout.pool import engine_of

POLL_S = 0.05  # how often the engines are looked at: a finished group reaches the pool, and an answer's next
# segment its engine, within about this (a continuation waits that long undecoded: docs/async.md's measurement)


class StreamingRollout(ContinuousRollout):
    def _run(self) -> None:
        live: dict[int, tuple[ray.ObjectRef, float]] = {}  # engine -> (its pass in flight, when it started)
        sent: dict[str, EngineRequest] = {}  # request id -> request: fed or in a pass, its result not back yet
        last = self._last_look = time.perf_counter()
        try:
            while True:
                plan, version = self._plan(live, sent)
                if plan is None:
                    return
                self._send(plan, version, live, sent)
                now = time.perf_counter()
                if live:
                    with self._cond:  # a take resets it
                        self.rollouts.seconds += now - last  # the rollout's wall time: while any engine generates
                    self._collect(live, sent)
                last = now
        except BaseException as e:  # raised on the main thread by its next take or pause
            with self._cond:
                self._error, self._in_pass, self._closed = e, False, True
                self._cond.notify_all()

    def _plan(self, live: dict, sent: dict) -> tuple[list[list[EngineRequest]] | None, int]:
        """Each engine's new requests (none while held or closing), or None once closed with no pass left. Waits
        (a slice) when there is nothing to run: until a take frees places, or a release."""
        with self._cond:
            while True:
                if self._closed and not live:
                    return None, self._version
                plan: list[list[EngineRequest]] = []
                # planned only when it has something to send (a place free for a new group, an answer with no
                # request in flight): a plan builds a request for every such answer, on the cores the engines
                # and the trainer share
                pool, in_flight = self.rollouts.pool, {(r.group, r.index) for r in sent.values()}
                if not (self._paused or self._closed) and (pool.num_missing or pool.has_waiting(in_flight)):
                    plan = self.rollouts.stream_requests(self._version, in_flight)
                if live or any(plan):
                    # set with the decision, under the lock: a pause that follows waits for these passes
                    self._in_pass = True
                    return plan, self._version
                self._in_pass = False
                self._cond.notify_all()
                self._cond.wait(JOIN_SLICE_S)

    def _send(self, plan: list[list[EngineRequest]], version: int, live: dict, sent: dict) -> None:
        """Into each engine's pass in flight, or a new pass where it has none. An engine whose pass was ending
        refuses them: they stay unsent, and the next plan has them again."""
        for e, requests in enumerate(plan):
            if not requests:
                continue
            engine = self.rollouts.engines[e]
            if e in live:
                if not ray.get(engine.stream_feed.remote(requests)):
                    continue
            else:
                ref = engine.run_pass.remote(requests, self.rollouts.sampling, None, version, True)
                live[e] = (ref, time.perf_counter())
            sent.update((r.request_id, r) for r in requests)

    def _collect(self, live: dict, sent: dict) -> None:
        """The results finished since the last look, and the passes that ended, into the pool."""
        engines = self.rollouts.engines
        # at most one look per POLL_S: a drain that returned at its first result would look again at every engine
        # step, and each look is a call into the engine's process beside its pass
        time.sleep(max(0.0, self._last_look + POLL_S - time.perf_counter()))
        self._last_look = time.perf_counter()
        refs = [ref for ref, _ in live.values()]
        ended, _ = ray.wait(refs, num_returns=len(refs), timeout=0)  # before the drains: see the module's hazards
        ended = set(ended)
        drained = ray.get([engines[e].stream_drain.remote(0.0) for e in live])
        finals = {e: ray.get(ref) for e, (ref, _) in live.items() if ref in ended}
        results = [r for out in [*drained, *finals.values()] for r in out["results"]]
        with self._cond:
            self.rollouts.stream_apply([sent.pop(r.request_id) for r in results], results, self._version)
            for out in drained:
                self.rollouts.stream_progress(out)
            num_engines = len(engines)
            for e, out in finals.items():
                started = live.pop(e)[1]
                self.rollouts.num_stream_passes += 1
                self._pass_spans.append((started, time.perf_counter()))
                for request_id in [i for i, r in sent.items() if engine_of(r.group, num_engines) == e]:
                    del sent[request_id]  # fed as the pass ended, never added: planned again
            self._in_pass = bool(live)
            self._cond.notify_all()
