"""`colocate plot`: what it refuses in one line, and a run killed mid-write (half a last line) still plots.
The full drawing runs on a real job's metrics in tests/e2e/test_failures.py."""

from __future__ import annotations

import json

import pytest

from colocate.errors import ConfigError
from colocate.telemetry.plot import read_steps


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


def plotted_step(step: int, **extra) -> dict:
    return {"step": step, "reward_mean": 0.5, "reward_min": 0.0, "reward_max": 1.0, "mismatch": 0.01,
            "mismatch_monitor": {"token": {"fraction_outside_band": 0.1}},
            "times": {"rollout": 1.0, "score": 0.1, "switch": 0.2, "train": 0.5, "sync": 0.1},
            "memory": {"engine_rss_bytes": 1 << 30, "trainer_rss_bytes": 2 << 30}, **extra}


def test_evaluations_and_kl_get_their_own_panels(tmp_path):
    pytest.importorskip("matplotlib")
    from colocate.telemetry.plot import draw_steps, plot_run

    steps = [plotted_step(0, kl=0.0, eval={"pass_at_1": 0.25, "pass_at_4": 0.5}), plotted_step(1, kl=0.01),
             plotted_step(2, kl=0.02, eval={"pass_at_1": 0.5, "pass_at_4": 0.75})]
    fig = draw_steps(steps, title="run")
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels) == ["reward", "evaluation", "training/inference mismatch", "KL to the reference policy",
                            "seconds per step, by phase", "memory (GiB)"]
    lines = {line.get_label(): line for line in panels["evaluation"].get_lines()}
    assert list(lines["pass@1"].get_xdata()) == [0, 2] and list(lines["pass@1"].get_ydata()) == [0.25, 0.5]
    assert list(lines["pass@4"].get_ydata()) == [0.5, 0.75]  # only the steps that evaluated
    assert list(panels["KL to the reference policy"].get_lines()[0].get_ydata()) == [0.0, 0.01, 0.02]

    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    assert plot_run(str(tmp_path)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_evaluations_or_kl_there_are_four_panels():
    pytest.importorskip("matplotlib")
    from colocate.telemetry.plot import draw_steps

    fig = draw_steps([plotted_step(0), plotted_step(1)], title="run")
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [
        "reward", "training/inference mismatch", "seconds per step, by phase", "memory (GiB)"]


def test_an_odd_number_of_panels_leaves_no_empty_cell():
    pytest.importorskip("matplotlib")
    from colocate.telemetry.plot import draw_steps

    fig = draw_steps([plotted_step(0, eval={"pass_at_1": 1.0}), plotted_step(1)], title="run")
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in titled] == ["reward", "evaluation", "training/inference mismatch",
                                                "seconds per step, by phase", "memory (GiB)"]
    untitled = [ax for ax in fig.axes if not ax.get_title()]
    assert all(ax.get_ylabel() == "share outside the band" for ax in untitled)  # only the mismatch's twin axis


def test_a_step_run_again_after_a_resume_counts_by_its_last_record(tmp_path):
    from colocate.telemetry.plot import read_steps

    records = [{"step": 0, "reward_mean": 0.1}, {"step": 1, "reward_mean": 0.2}, {"event": "resume", "step": 0},
               {"step": 1, "reward_mean": 0.3}, {"step": 2, "reward_mean": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [(r["step"], r["reward_mean"]) for r in read_steps(str(tmp_path))] == [(0, 0.1), (1, 0.3), (2, 0.4)]
