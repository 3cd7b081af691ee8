"""Metrics: one JSON line per step in `<output_dir>/metrics.jsonl`, fanned out to the optional sinks (TensorBoard,
Weights & Biases: colocate/telemetry/sinks.py), and progress on stderr.

Each record is flushed as it is written, so a run that stops (error, Ctrl-C) keeps every finished step. The JSONL
is the source of truth: events ({"event": "startup"}, errors) and the text of samples go there only. A run killed
mid-write (SIGKILL) leaves half a last line: readers skip it (`read_records`), and the next run in the same
directory (a resume) cuts it off before it appends, so its records never share a line with the fragment.

Progress: on a terminal one line that updates in place (a bar, step i/N, reward, eval pass@1, elapsed and ETA,
phase times); elsewhere (CI, `ray job logs`, a file) one plain line per step, which a carriage return would garble.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from colocate.config import LoggingConfig
from colocate.telemetry.sinks import Sink, open_sinks, scalar_tags

log = logging.getLogger("colocate")


def drop_torn_tail(path: Path) -> int:
    """Cut a last line that has no newline (a record a killed writer left half-written); returns its bytes."""
    if not path.is_file():
        return 0
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        start = max(0, size - (1 << 20))  # a record is at most a few KiB: search the last MiB for its start
        f.seek(start)
        tail = f.read()
        keep = start + tail.rfind(b"\n") + 1 if b"\n" in tail else start
        f.truncate(keep)
        return size - keep


def read_records(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped. A line inside the
    file that is not JSON raises ValueError naming it."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not JSON") from None
    return records


class MetricsWriter:
    def __init__(self, cfg: LoggingConfig, *, num_steps: int, run_config: dict | None = None,
                 stream: TextIO | None = None, terminal: bool | None = None):
        """`run_config` (the whole job config) becomes the W&B run's config; `stream` and `terminal` default to
        stderr and whether it is a terminal."""
        self.dir = Path(cfg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        # first: a missing wandb package is a ConfigError before anything is written or started
        self.sinks: list[Sink] = open_sinks(cfg, run_config)
        self.path = self.dir / "metrics.jsonl"
        dropped = drop_torn_tail(self.path)
        self._file = open(self.path, "a", buffering=1)
        self.progress = Progress(num_steps, stream or sys.stderr, terminal) if cfg.progress else None
        self._failed = False
        if dropped:
            self.write({"event": "torn_record_dropped", "bytes": dropped})

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({"time": time.time(), **record}) + "\n")
        if "event" in record:
            self._failed |= record["event"] == "error"
            if self.progress:
                self.progress.event()

    def step(self, record: dict) -> None:
        self.write(record)
        self._log(scalar_tags(record), step=record["step"] + 1)
        if self.progress:
            self.progress.show(record)

    def evaluation(self, result: dict, *, num_done: int) -> None:
        """An evaluation that belongs to no step's record (the one before the first step): a JSONL event, and
        the sinks' eval/ tags at step `num_done`."""
        self.write({"event": "eval", "num_done": num_done, "eval": result})
        self._log(scalar_tags({"eval": result}), step=num_done)

    def _log(self, tags: dict[str, float], *, step: int) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(tags, step=step)
            except Exception:  # a view of the metrics failing (full disk, W&B hiccup) must not end the run
                log.warning("%s failed and is turned off; %s keeps every step", type(sink).__name__, self.path,
                            exc_info=True)
                self.sinks.remove(sink)

    def close(self) -> None:
        if self.progress:
            self.progress.end_line()
        self._file.close()
        for sink in self.sinks:
            try:
                sink.close(failed=self._failed)
            except Exception:  # the job's own outcome (and exit code) matters more than a sink's shutdown
                log.warning("closing %s failed", type(sink).__name__, exc_info=True)


class Progress:
    """The per-step line. ETA = the mean step time so far x the steps left; the step clock starts at the last
    event before the first step (the startup record: actors up, model loaded), so startup does not count."""

    BAR_WIDTH = 20

    def __init__(self, num_steps: int, stream: TextIO, terminal: bool | None = None, width: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`terminal`: the stream is a terminal (default: ask it); `width`: its columns (default: ask it)."""
        self.num_steps = num_steps
        self.stream = stream
        self.terminal = stream.isatty() if terminal is None else terminal
        self.width = width
        self.clock = clock
        self.started = clock()
        self._steps_since = self.started
        self._num_shown = 0
        self._first_reward: float | None = None
        self._last_eval: tuple[int, float] | None = None  # (step, pass@1): the bar keeps showing it
        self._line_open = False

    def event(self) -> None:
        if self._num_shown == 0:
            self._steps_since = self.clock()
        self.end_line()  # whatever is printed about the event starts on a line of its own

    def show(self, record: dict) -> None:
        now = self.clock()
        self._num_shown += 1
        if self._first_reward is None:
            self._first_reward = record["reward_mean"]
        if "eval" in record:
            self._last_eval = (record["step"] + 1, record["eval"]["pass_at_1"])
        if not self.terminal:
            print(self.plain_line(record, now), file=self.stream, flush=True)
            return
        # cut to the terminal's width: a wrapped line cannot be redrawn in place; the phase times go first
        line = self.terminal_line(record, now)[:(self.width or _width(self.stream)) - 1]
        self.stream.write("\r" + line + "\x1b[K")  # \x1b[K clears what a longer previous line left
        self._line_open = True
        if record["step"] + 1 >= self.num_steps:
            self.end_line()
        self.stream.flush()

    def end_line(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self.stream.flush()
            self._line_open = False

    def timing(self, record: dict, now: float) -> str:
        mean_step = (now - self._steps_since) / max(self._num_shown, 1)
        left = max(self.num_steps - (record["step"] + 1), 0)
        return f"{format_duration(now - self.started)} elapsed, ETA {format_duration(mean_step * left)}"

    def terminal_line(self, record: dict, now: float) -> str:
        done = record["step"] + 1
        filled = min(self.BAR_WIDTH, self.BAR_WIDTH * done // max(self.num_steps, 1))
        bar = "#" * filled + "-" * (self.BAR_WIDTH - filled)
        text = (f"[{bar}] {done}/{self.num_steps} | {self.timing(record, now)} | reward {record['reward_mean']:.3f} "
                f"(start {self._first_reward:.3f})")
        if self._last_eval is not None:
            text += f" | eval pass@1 {self._last_eval[1]:.3f} (step {self._last_eval[0]})"
        phases = " ".join(f"{name} {seconds:.1f}s" for name, seconds in record["times"].items())
        return f"{text} | {phases}"

    def plain_line(self, record: dict, now: float) -> str:
        r, t = record, record["times"]
        text = (f"step {r['step'] + 1:>3}/{self.num_steps} | reward {r['reward_mean']:.3f} "
                f"(start {self._first_reward:.3f}) | len {r['response_len_mean']:.1f} | "
                f"rollout {t['rollout']:.2f}s score {t['score']:.2f}s train {t['train']:.2f}s "
                f"sync {t['sync']:.2f}s switch {t['switch']:.2f}s | {r['rollout_tokens_per_s']:.0f} tok/s | "
                f"mismatch {r['mismatch']:.4f}" + _outside_band(r))
        if "eval" in r:
            text += f" | eval pass@1 {r['eval']['pass_at_1']:.3f}"
        return f"{text} | {self.timing(record, now)}"


def format_duration(seconds: float) -> str:
    """5 -> "5s", 65 -> "1m05s", 3700 -> "1h01m": short enough for a progress line, exact enough for an ETA."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 120  # some pseudo-terminals say 0
    except (AttributeError, OSError, ValueError):  # not a real terminal (a test's StringIO)
        return 120


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
