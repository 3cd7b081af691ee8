"""The soak's verdict on synthetic series: which windows it compares, and what passes the 5% band."""

from __future__ import annotations

import os
import random

import pytest

from colocate.bench.soak import process_resources, summarize, what_changed, windows

MB = 2**20


def test_a_long_run_compares_steps_20_to_29_with_the_last_10():
    assert windows(200, baseline_step=20, window=10) == (slice(20, 30), slice(190, 200))


def test_a_short_run_shrinks_both_windows_but_keeps_one_step_each():
    base, end = windows(3, baseline_step=20, window=10)
    assert (base, end) == (slice(1, 2), slice(2, 3))
    assert summarize({"rss_bytes/x": [1, 1, 1]})["short_run"]


def test_a_flat_series_passes_and_a_flat_count_says_so():
    s = summarize({"rss_bytes/trainer0": [500 * MB] * 200, "fds/trainer0": [40] * 200})
    assert s["all_pass"]
    assert s["resources"]["rss_bytes/trainer0"]["growth"] == 0.0
    assert s["resources"]["fds/trainer0"]["flat"] and s["resources"]["fds/trainer0"]["abs_change"] == 0


def test_six_percent_growth_fails():
    ramp = [100 * MB + (6 * MB * i) // 199 for i in range(200)]  # +6% over the run, most of it after step 20
    flat_then_step = [100 * MB] * 100 + [106 * MB] * 100
    s = summarize({"rss_bytes/leaky": ramp, "rss_bytes/stepped": flat_then_step})
    assert not s["all_pass"]
    assert not s["resources"]["rss_bytes/stepped"]["pass"]
    assert s["resources"]["rss_bytes/stepped"]["growth"] == pytest.approx(0.06)
    # a ramp is judged from step 20, not step 0: 100.7 MiB (steps 20..29) to 105.9 (190..199), +5.1%
    assert not s["resources"]["rss_bytes/leaky"]["pass"]
    assert s["resources"]["rss_bytes/leaky"]["growth"] == pytest.approx(0.051, abs=0.001)


def test_noise_within_the_band_passes_even_with_single_spikes():
    rng = random.Random(0)
    noisy = [100 * MB * (1 + rng.uniform(-0.03, 0.03)) for _ in range(200)]
    noisy[195] = 150 * MB  # one checkpoint-like spike in the end window: the median ignores it
    s = summarize({"rss_bytes/noisy": noisy, "fds/noisy": [40 + (i % 3 == 0) for i in range(200)]})
    assert s["all_pass"], s["resources"]
    assert s["resources"]["rss_bytes/noisy"]["max"] == 150 * MB


def test_counts_growing_fail_and_report_the_absolute_change():
    s = summarize({"fds/engine0": [40] * 100 + [48] * 100, "shm_entries/job": [5] * 200})
    assert s["resources"]["fds/engine0"]["abs_change"] == 8 and not s["resources"]["fds/engine0"]["pass"]
    assert s["resources"]["shm_entries/job"]["flat"]


def test_from_zero_only_staying_at_zero_passes_and_missing_readings_fail():
    s = summarize({"shm_entries/job": [0] * 200, "shm_used_bytes/x": [0] * 100 + [MB] * 100,
                   "rss_bytes/gone": [MB] * 20 + [None] * 180})
    rows = s["resources"]
    assert rows["shm_entries/job"]["pass"]
    assert not rows["shm_used_bytes/x"]["pass"]
    assert not rows["rss_bytes/gone"]["pass"] and rows["rss_bytes/gone"]["note"] == "not recorded"


def test_this_process_is_read_from_proc():
    me = process_resources(os.getpid())
    assert me["rss_bytes"] > 0 and me["fds"] >= 3 and me["threads"] >= 1


def test_a_count_that_stepped_once_says_where():
    s = summarize({"threads/controller": [30] * 54 + [32] * 146})
    row = s["resources"]["threads/controller"]
    assert row["abs_change"] == 2 and not row["pass"] and row["last_change_step"] == 54


def test_what_changed_names_the_fds_and_threads_that_appeared():
    before = {"controller": {"fds": ["pipe", "socket"], "threads": ["python"]}}
    after = {"controller": {"fds": ["pipe", "socket", "socket"], "threads": ["python"]},
             "trainer0": {"fds": ["pipe"], "threads": []}}
    assert what_changed(before, after) == {"controller": {"fds": {"added": {"socket": 1}, "gone": {}}},
                                           "trainer0": {"fds": {"added": {"pipe": 1}, "gone": {}}}}


def test_what_changed_splits_rss_growth_by_kind_of_page():
    before = {"trainer0": {"fds": [], "threads": [], "rss": {"anon": 100, "file": 50, "shmem": 10}}}
    after = {"trainer0": {"fds": [], "threads": [], "rss": {"anon": 160, "file": 50, "shmem": 10}}}
    assert what_changed(before, after) == {"trainer0": {"rss": {"anon": 60, "file": 0, "shmem": 0}}}
    assert what_changed(before, before) == {}
