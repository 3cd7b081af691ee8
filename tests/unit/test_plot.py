"""`colocate plot`: what it refuses in one line, and a run killed mid-write (half a last line) still plots.
The full drawing runs on a real job's metrics in tests/e2e/test_failures.py."""

from __future__ import annotations

import json

import pytest

from colocate.config import ConfigError
from colocate.plot import read_steps


def test_a_directory_without_metrics_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="has no metrics.jsonl"):
        read_steps(str(tmp_path))


def test_events_are_skipped_and_a_torn_last_line_tolerated(tmp_path):
    lines = [json.dumps({"event": "startup"}), json.dumps({"step": 0}), json.dumps({"step": 1}), '{"step": 2, "rew']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert [r["step"] for r in read_steps(str(tmp_path))] == [0, 1]


def test_a_torn_line_inside_the_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"st\n{"step": 1}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_steps(str(tmp_path))


def test_a_run_without_a_finished_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "startup"}) + "\n")
    with pytest.raises(ConfigError, match="no finished step"):
        read_steps(str(tmp_path))
