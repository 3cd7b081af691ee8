"""engine/stream.py's PassStream, the two threads of a streamed pass: every result leaves once, a feed racing the
pass's end either lands in it or is refused, and a closed stream drops what it never added."""

from __future__ import annotations

import threading

from colocate.engine.requests import EngineRequest, RequestResult
from colocate.engine.stream import PassStream


def request(i: int) -> EngineRequest:
    return EngineRequest(f"r{i}", i, 0, [1, 2], 4, True, seed=i)


def test_a_feed_before_the_pass_opens_or_after_it_ends_is_refused():
    stream = PassStream()
    assert not stream.feed([request(0)])
    stream.open()
    assert stream.feed([request(1)])
    assert stream.take_inbox() == [request(1)] and stream.take_inbox() == []
    assert stream.close_if_idle() and not stream.is_open
    assert not stream.feed([request(2)])


def test_a_pass_with_something_fed_does_not_end_and_a_forced_end_drops_it():
    stream = PassStream()
    stream.open()
    assert stream.feed([request(0)])
    assert not stream.close_if_idle() and stream.is_open  # the pass must add it first
    assert stream.take_inbox() == [request(0)]
    assert stream.feed([request(1)])
    stream.close()  # the rollout is ending: what was not added is the driver's to plan again
    assert stream.take_inbox() == [] and not stream.feed([request(2)])


def test_results_leave_once_in_order_and_a_drain_waits_for_the_first():
    stream = PassStream()
    stream.open()
    assert stream.drain() == []
    got: list = []
    waiting = threading.Thread(target=lambda: got.extend(stream.drain(wait_s=10.0)))
    waiting.start()
    stream.finished(RequestResult("r0", [7], [-0.1], "stop", 0))
    waiting.join(timeout=10.0)
    assert not waiting.is_alive() and [r.request_id for r in got] == ["r0"]
    stream.finished(RequestResult("r1", [8], [-0.2], "length", 0))
    stream.finished(RequestResult("r2", [9], [-0.3], "length", 0))
    stream.close()
    assert [r.request_id for r in stream.drain()] == ["r1", "r2"] and stream.drain() == []  # kept past the end
    stream.open()  # the next pass starts with nothing in either list
    assert stream.take_inbox() == [] and stream.drain() == []


def test_the_steps_are_reported_once_across_looks_and_passes():
    stream = PassStream()
    stream.open()
    stream.stepped((0.01, 3), 3, 3)
    stream.stepped((0.02, 2), 2, 5)  # speculative decoding: more tokens than request steps
    assert stream.progress() == ([(0.01, 3), (0.02, 2)], [5, 8])
    assert stream.progress() == ([], [0, 0])
    stream.stepped((0.03, 1), 1, 1)
    stream.close()
    stream.open()  # a step of the last pass not yet looked at is reported by the next look
    assert stream.progress() == ([(0.03, 1)], [1, 1])
