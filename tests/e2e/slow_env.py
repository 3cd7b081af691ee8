"""Environments for tests/e2e/test_env_workers.py, imported by name in the environment workers (Ray actors)."""

from __future__ import annotations

import os
import time


class SlowEnv:
    """Each step takes 0.5 s and says which process ran it and when (pid:start_ms:end_ms, in the toy vocabulary)."""

    def reset(self, sample) -> str:
        return sample.prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        start = time.time()
        time.sleep(0.5)
        return f"{os.getpid()}:{int(start * 1000)}:{int(time.time() * 1000)}", 1.0, False
