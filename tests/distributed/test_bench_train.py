"""`colocate bench train` as a user runs it, on the tiny model at one length: every variant measured in a rank of
its own, each row beside its prediction and today's path, the JSON and the PNG written. (The recorded run, on the
bench preset at 128 .. 4096 tokens, is benchmarks/results/train.json.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from colocate.host.procfs import cmdline, process_tree, same_process

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_measures_every_variant_and_writes_json_and_png(tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / "colocate"), "bench", "train", "model.preset=tiny",
                           f"model.cache_dir={ROOT / '.cache' / 'models'}", "--lengths", "128", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "train.json").read_text())
    variants = {"today", "chunked", "checkpointed", "packed", "all"}
    if result["cpu_bf16_features"]:  # bf16 alone, and every feature but bf16 beside all of them
        variants |= {"bf16", "all_fp32"}
    assert {row["variant"] for row in result["rows"]} == variants and result["lengths"] == [128]
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["measured_step_bytes"] > 0 and row["predicted_step_bytes"] > 0
        assert row["preflight_bound_bytes"] >= row["predicted_step_bytes"]  # the bound is the worst the config allows
        assert row["attention"] == "sdpa"
    packed = next(row for row in result["rows"] if row["variant"] == "packed")
    today = next(row for row in result["rows"] if row["variant"] == "today")
    assert packed["num_micro_batches"] < today["num_micro_batches"] == 4  # the short answers share a row
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "less step memory" in done.stdout


def test_a_sigterm_stops_the_bench_and_the_process_measuring_for_it(tmp_path):
    # `kill`, a scheduler, a CI timeout: Python's default for SIGTERM would end the bench alone, and its measuring
    # process (a daemon, ended only by a normal exit) would run on, taking the memory and cores the next run
    # measures
    bench = subprocess.Popen([str(Path(sys.executable).parent / "colocate"), "bench", "train", "model.preset=tiny",
                              f"model.cache_dir={ROOT / '.cache' / 'models'}", "--lengths", "128", "--out",
                              str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (measuring := [e for e in process_tree(bench.pid)[1:] if "spawn_main" in cmdline(e["pid"])]):
        assert bench.poll() is None and time.monotonic() < deadline, "no measuring process came up"
        time.sleep(0.1)
    bench.send_signal(signal.SIGTERM)
    _, stderr = bench.communicate(timeout=60)
    assert bench.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "colocate: bench train stopped (SIGTERM)"
    deadline = time.monotonic() + 10
    while any(same_process(e) for e in measuring):
        assert time.monotonic() < deadline, f"the measuring process outlived its bench: {measuring}"
        time.sleep(0.1)
