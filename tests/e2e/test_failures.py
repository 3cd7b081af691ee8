"""Bad runtime input and interruptions, as a user meets them through `colocate launch`: one clear line, the
finished steps kept, and nothing left behind (no Ray process, vLLM worker or /dev/shm segment). The full run is
the shipped prompt-file job (configs/math.yaml), so every named reward's mean is checked in its records too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e.conftest import ROOT, assert_nothing_left, colocate_processes, launch, shm_segments, sigint_ignored

pytestmark = pytest.mark.e2e


@pytest.fixture
def baseline():
    return colocate_processes(), shm_segments()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("colocate:")]


def test_a_full_run_ends_clean_and_writes_metrics(tmp_path, baseline):
    # the shipped prompt-file job (configs/math.yaml: the arithmetic set, math + char rewards), shrunk
    result = launch(tmp_path, "algo.num_steps=2", config="configs/math.yaml")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "startup" and records[0]["sync_mode"] == "sliced"
    assert records[0]["engines"][0]["start_s"] > 0
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [1]  # at the end (checkpoint.at_end)
    records = [r for r in records[1:] if "event" not in r]
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward_mean", "rollout_tokens_per_s", "sync_s", "mismatch", "memory", "times"):
        assert key in records[0]
    for record in records:  # the mismatch monitor, every step: every response token and sequence counted
        monitor = record["mismatch_monitor"]
        assert monitor["token"]["count"] == record["num_response_tokens"] > 0
        assert monitor["sequence"]["count"] == 4 * 4  # prompts x samples
        assert 0 < monitor["token"]["ratio_quantiles"]["p50"] < 2 and record["correction"]["mode"] == "none"
        # each named reward's mean, and the total as the config weighs them
        assert 0 <= record["reward_math_mean"] <= 1 and 0 <= record["reward_char_mean"] <= 1
        assert record["reward_mean"] == pytest.approx(record["reward_math_mean"] + 0.5 * record["reward_char_mean"])
    assert "Traceback" not in result.stderr
    plotted = subprocess.run([os.path.join(os.path.dirname(os.sys.executable), "colocate"), "plot",
                              str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert (tmp_path / "out" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_nothing_left(*baseline)


def test_model_directory_without_a_model(tmp_path, baseline):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    result = launch(tmp_path, f"model.path={empty}", "algo.num_steps=1")
    assert result.returncode == 2  # caught before any actor starts
    lines = error_lines(result.stderr)
    assert lines == [f"colocate: error: model.path={str(empty)!r} is invalid: the directory has no config.json "
                     "(not a Hugging Face model directory)"]
    assert "Traceback" not in result.stderr
    assert_nothing_left(*baseline)


def test_kv_cache_larger_than_the_machine_is_stopped_by_the_preflight(tmp_path, baseline):
    result = launch(tmp_path, "engine.kv_cache_gib=100000", "algo.num_steps=1")
    assert result.returncode == 2  # before any actor starts
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "memory preflight: phase 'rollout'" in lines[0] and "engine.kv_cache_gib" in lines[0]
    assert_nothing_left(*baseline)


def test_engine_that_fails_to_start(tmp_path, baseline):
    # the tiny model has 4,096 positions: vLLM refuses a longer context when the engine starts. One slot: the
    # refusal is the engine actor's own, before it starts a worker, whatever the layout
    result = launch(tmp_path, "engine.max_model_len=100000", "algo.num_steps=1", "placement.num_slots=1",
                    "engine.tp=1")
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert lines and "engine failed to start" in lines[0] and "max_model_len" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert_nothing_left(*baseline)


def test_reward_function_that_raises_keeps_finished_steps(tmp_path, baseline):
    # one slot (a trainer rank, a TP=1 engine): the reward's failure is the driver's, whatever the layout
    result = launch(tmp_path, "rollout.reward_fn=tests.e2e.rewards:explode_in_second_step", "algo.num_steps=4",
                    "placement.num_slots=1", "engine.tp=1")
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert "user reward bug" in lines[0] and "on prompt '" in lines[0], result.stderr[-2000:]
    assert "1 finished step(s) kept" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "startup"
    assert records[1]["step"] == 0 and records[-1]["event"] == "error" and records[-1]["step"] == 1
    assert_nothing_left(*baseline)


@pytest.mark.parametrize("signum, code, said, layout", [
    # a terminal's Ctrl-C: the whole group, the engine's TP worker processes with it
    pytest.param(signal.SIGINT, 130, "interrupted", (), id="ctrl_c"),
    # kill, a scheduler, `ray job stop`: the job's process alone; one slot (a trainer rank, a TP=1 engine)
    pytest.param(signal.SIGTERM, 143, "stopped (SIGTERM)", ("placement.num_slots=1", "engine.tp=1"), id="sigterm"),
])
def test_ctrl_c_and_sigterm_stop_cleanly(tmp_path, baseline, signum, code, said, layout):
    metrics = tmp_path / "out" / "metrics.jsonl"
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(os.sys.executable), "colocate"), "launch", "configs/default.yaml",
         "algo.num_steps=1000", "rollout.num_prompts=4", "rollout.num_samples=4", "engine.kv_cache_gib=0.125",
         f"logging.output_dir={tmp_path / 'out'}", f"model.cache_dir={ROOT / '.cache' / 'models'}", *layout],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=sigint_ignored)
    try:
        deadline = time.time() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            time.sleep(0.5)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)  # to the job's process only, as Ray's job supervisor or `kill` sends it
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, stderr[-2000:]
    assert said in stderr and "finished step(s) kept" in stderr
    assert_nothing_left(*baseline)
