"""algo.mode=one_step_off's pieces that need no actors: its config checks, its memory plan (both sides resident,
refused in one line naming the phase and the shortfall when they cannot be), the staleness it reports, and the
background call its next rollout runs in. The switching order with it is tests/unit/test_switching_order.py; the
real stack, tests/e2e/test_algorithms.py."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from pathlib import Path

import pytest

from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.job.faults import INTERRUPT_SIGNAL, WatchdogInterrupt, _raise_watchdog_interrupt
from colocate.rollout.overlap import Background
from colocate.job.preflight import GIB, ONE_STEP_OFF_PLAN, model_dims, plan_switch, predict_phases, preflight
from colocate.rollout.passes import lag_histogram

QWEN_7B = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "Qwen2.5-7B")
H100 = int(79.6 * GIB)


@pytest.mark.parametrize("overrides, needles", [
    (["engine.sleep_level=2"], ["engine.sleep_level='2' is invalid", "never sleeps", "auto or 0"]),
    (["trainer.offload=true"], ["trainer.offload='true' is invalid", "auto or false"]),
    (["rollout.max_lag=0"], ["rollout.max_lag=0 is invalid", "one policy version before", ">= 1"]),
    (["rollout.partial_tokens=4", "rollout.max_tokens=6"], ["rollout.partial_tokens=4 is invalid",
                                                          "within rollout.max_lag = 1 passes", ">= 6"]),
    (["algo.mode=fully_async"], ["algo.mode='fully_async' is invalid", "sync, one_step_off, async"]),
], ids=["sleeping_engine", "offloaded_trainer", "no_lag_allowed", "partial_needs_passes", "unknown_mode"])
def test_bad_one_step_off_settings_are_one_line(overrides, needles):
    mode = [] if overrides[0].startswith("algo.mode") else ["algo.mode=one_step_off"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*mode, *overrides])
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_what_one_step_off_accepts():
    load_config(None, ["algo.mode=one_step_off", "engine.sleep_level=0", "trainer.offload=false"])
    # partial rollout within the lag: max_tokens=6 in 2 passes of 3, a version old already when trained
    load_config(None, ["algo.mode=one_step_off", "rollout.partial_tokens=3", "rollout.max_tokens=6",
                       "rollout.max_lag=2"])


def test_one_step_off_keeps_both_sides_resident_in_every_phase():
    cfg = load_config(None, ["algo.mode=one_step_off", "model.preset=bench", "trainer.micro_batch_size=1",
                             "engine.kv_cache_gib=2"])
    # the budget where sync mode must sleep the engine and offload the trainer (test_preflight.py)
    assert plan_switch(cfg, model_dims(cfg), device="cpu", available_bytes=11 * GIB) == ONE_STEP_OFF_PLAN
    train = next(p for p in predict_phases(cfg, model_dims(cfg), device="cpu", plan=ONE_STEP_OFF_PLAN)
                 if p.name == "train")
    assert train.parts["engine awake (weights + kv cache)"] > 2 * GIB  # the engine's KV cache beside training


@pytest.mark.parametrize("overrides, device, available", [
    (["model.preset=bench", "trainer.micro_batch_size=1", "engine.kv_cache_gib=2"], "cpu", 11 * GIB),
    ([f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2", "rollout.max_tokens=64"], "cuda", H100),
], ids=["bench_on_11gib_cpu", "qwen7b_8x80gib"])
def test_one_step_off_that_cannot_fit_names_the_phase_and_the_shortfall(overrides, device, available):
    cfg = load_config(None, overrides)
    sync = preflight(cfg, model_dims(cfg), device=device, available_bytes=available)
    assert sync.plan.engine_sleep_level == 2  # sync mode fits only by putting the engine to sleep
    with pytest.raises(ConfigError) as info:
        preflight(load_config(None, ["algo.mode=one_step_off", *overrides]), model_dims(cfg), device=device,
                  available_bytes=available)
    message = str(info.value)
    # training overlaps the rollout: the first phase found short may be either (both hold both sides)
    assert "\n" not in message and ("phase 'train'" in message or "phase 'rollout'" in message), message
    assert "short by" in message, message
    assert "algo.mode=one_step_off keeps the engine awake" in message and "algo.mode=sync" in message, message


def test_lag_histogram_counts_tokens_per_version_behind():
    # tokens of versions 3, 3, 4, 5 trained by policy 5: two 2 versions behind, one 1 behind, one on-policy
    assert lag_histogram([3, 3, 4, 5], 5) == {"0": 1, "1": 1, "2": 2}
    assert lag_histogram([], 5) == {}


def test_background_returns_its_result_and_raises_its_error_on_the_waiting_thread():
    assert Background(lambda a, *, b: a + b, 1, b=2).wait() == 3

    def fail():
        raise RuntimeError("engine lost")

    with pytest.raises(RuntimeError, match="engine lost"):
        Background(fail).wait()


def test_background_wait_is_interrupted_by_the_watchdogs_interrupt():
    """The watchdog reports a fault with _thread.interrupt_main(INTERRUPT_SIGNAL) and its own handler (as
    Watchdog.__enter__ installs it); a main thread waiting on the next rollout must see it at once, not when the
    rollout ends (a rollout on a lost node may never end). Its own signal, not SIGINT: a pytest worker started in
    the background inherits SIGINT ignored, and interrupt_main() then does nothing (seen in a CI run)."""
    previous = signal.signal(INTERRUPT_SIGNAL, _raise_watchdog_interrupt)
    try:
        ahead = Background(time.sleep, 30)
        threading.Timer(0.3, _thread.interrupt_main, args=(INTERRUPT_SIGNAL,)).start()
        started = time.monotonic()
        with pytest.raises(WatchdogInterrupt):
            ahead.wait()
    finally:
        signal.signal(INTERRUPT_SIGNAL, previous)
    assert time.monotonic() - started < 10 and not ahead.done  # the daemon thread is left; it cannot block exit
