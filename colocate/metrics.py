"""Metrics: one JSON line per step in `<output_dir>/metrics.jsonl`, and a compact live line per step.

Each record is flushed as it is written, so a run that stops (error, Ctrl-C) keeps every finished step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsWriter:
    def __init__(self, output_dir: str, *, progress: bool, num_steps: int):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self.progress = progress
        self.num_steps = num_steps
        self._first_reward: float | None = None

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({"time": time.time(), **record}) + "\n")

    def step(self, record: dict) -> None:
        self.write(record)
        if self.progress:
            print(self.format_step(record), file=sys.stderr, flush=True)

    def format_step(self, r: dict) -> str:
        if self._first_reward is None:
            self._first_reward = r["reward_mean"]
        t = r["times"]
        return (f"step {r['step'] + 1:>3}/{self.num_steps} | reward {r['reward_mean']:.3f} "
                f"(start {self._first_reward:.3f}) | len {r['response_len_mean']:.1f} | "
                f"rollout {t['rollout']:.2f}s score {t['score']:.2f}s train {t['train']:.2f}s "
                f"sync {t['sync']:.2f}s switch {t['switch']:.2f}s | {r['rollout_tokens_per_s']:.0f} tok/s | "
                f"mismatch {r['mismatch']:.4f}" + _outside_band(r))

    def close(self) -> None:
        self._file.close()


def _outside_band(r: dict) -> str:
    """The share of tokens whose ratio p_trainer / p_engine left the monitor's band, and what a correction
    changed (TIS truncated, MIS masked)."""
    monitor = r.get("mismatch_monitor", {})
    if not monitor.get("token", {}).get("count"):
        return ""
    text = f" ({monitor['token']['fraction_outside_band']:.1%} outside x{monitor['band']:g})"
    correction = r.get("correction", {})
    if correction.get("mode", "none") != "none":
        text += f" | {correction['mode']} {correction['fraction_affected']:.1%}"
    return text
