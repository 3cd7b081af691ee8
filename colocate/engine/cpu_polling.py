"""Stop vLLM's message queues from busy-polling on a CPU node.

vLLM's shared-memory message queue (executor <-> TP workers) keeps every reader spinning on `sched_yield` for
1 s after each message it reads (`SpinCondition(busy_loop_s=1)`), to shave microseconds off the next RPC. On a
GPU node the spinning cores are idle anyway. On a CPU node the cores *are* the device: measured on our 2-core
machine, during a weight sync (an RPC per bucket) the two TP workers and the engine process burned ~320 ms of
CPU per sync on polling, more than the trainers' cast-and-write itself, and after every rollout the readers
keep spinning for a second into the training phase. With the busy loop off, a reader blocks on the queue's
zmq notification, which every write already sends; an RPC costs tens of microseconds more.

Hazard: a notification can be lost (the writer's PUB socket keeps at most one unsent message, SNDHWM=1, and
drops the rest), and a blocked reader then sleeps until its recheck interval, 5 s in vLLM 0.32
(`SHM_READER_RECHECK_INTERVAL_MS`), with the message already in the buffer. vLLM's own spinning readers never
wait on the socket right after a read, so they never meet it; without the spin it stalled engine steps by 5 s
whenever requests of a batch finished at different times (measured: 128 requests of mixed lengths, 0.5 s
decoding became 21 s). So the recheck interval goes down to 10 ms too: a lost notification costs at most that,
and an idle reader wakes 100 times a second to look at one flag instead of spinning.

Applied in the engine process (before the LLM is built) and in each TP worker (vLLM imports the worker
extension before it creates the worker's queues).
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger("colocate")

RECHECK_INTERVAL_MS = 10


def stop_busy_polling() -> bool:
    """Make new message-queue readers block instead of spinning. Returns whether the patch applied (a vLLM
    release without this knob is left alone, and said so)."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    params = inspect.signature(spin.__init__).parameters if spin is not None else {}
    if "busy_loop_s" not in params or spin.__init__.__defaults__ != (params["busy_loop_s"].default,):
        log.warning("vLLM's message queue has no busy_loop_s knob in this release: readers keep spinning")
        return False
    spin.__init__.__defaults__ = (0.0,)
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_INTERVAL_MS  # read on every wait, at call time
    return True
