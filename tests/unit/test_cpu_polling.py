"""The CPU message-queue patch: readers block instead of spinning, and a lost notification costs a 10 ms
recheck, not vLLM's 5 s (which stalled engine steps whenever requests of a batch finished at different times).
The patch must land where vLLM reads the values: SpinCondition's default and the module constant read at each
wait."""

from __future__ import annotations

import inspect

from colocate.engine.cpu_polling import RECHECK_INTERVAL_MS, stop_busy_polling


def test_readers_block_and_recheck_often():
    from vllm.distributed.device_communicators import shm_broadcast

    assert stop_busy_polling()
    assert inspect.signature(shm_broadcast.SpinCondition.__init__).parameters["busy_loop_s"].default == 0.0
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == RECHECK_INTERVAL_MS == 10
    # vLLM reads the constant inside the wait, so the patched value is the one used
    source = inspect.getsource(shm_broadcast.MessageQueue.ReadTimeoutWithWarnings.timeout_ms)
    assert "SHM_READER_RECHECK_INTERVAL_MS" in source
