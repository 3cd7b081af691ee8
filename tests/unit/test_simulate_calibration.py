"""The CPU calibration's file and the CPU model's use of it (simulate/hardware.py Calibration, simulate/cpu.py), with
a made-up calibration: no engine, no trainer. The measurement itself is `colocate simulate --calibrate
--against rollout`, a benchmark (benchmarks/results/simulate_cpu.json)."""

import json

import pytest

from colocate.bench.rollout import MODES, ROLLOUT_DEFAULTS
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.simulate.calibrate import predict_bench_rollout
from colocate.simulate.cpu import CpuEngine, predict_rollout, train_step_s
from colocate.simulate.hardware import Calibration


def _cal() -> Calibration:
    # a step of 10 ms + 1 ms per 8 running, 1 us per context token (measured at two contexts a batch size)
    rows = [(b, b * c, 0.010 + b / 8000 + 1e-6 * b * c) for b in (1, 8, 64) for c in (40, 80)]
    return Calibration(machine={"cpu": "test"}, decode_step_s=rows, train_step_s=[(6144, 2.0), (12288, 3.5)],
                       sync_s=0.4, switch_s={"to_train": 0.3, "to_sync": 0.1, "to_rollout": 0.2, "seconds": 0.6},
                       prefill_s_per_token=1e-4, prompt_tokens=20, num_engines=1, max_num_seqs=64,
                       config=["rollout.max_tokens=480"])


def test_round_trip(tmp_path):
    cal = _cal()
    cal.save(tmp_path / "c.json")
    assert Calibration.load(tmp_path / "c.json") == cal


def test_a_file_that_is_not_a_calibration_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"cpu": 1}))
    with pytest.raises(ConfigError, match="not a calibration"):
        Calibration.load(tmp_path / "bad.json")


def test_decode_step_interpolates_by_batch_and_carries_the_context_term():
    engine = CpuEngine(_cal())
    assert engine.step_s(8, 8 * 60) == pytest.approx(0.010 + 8 / 8000 + 1e-6 * 8 * 60)
    between = engine.step_s(36, 36 * 60)  # between 8 and 64: linear in the batch
    assert engine.step_s(8, 8 * 60) < between < engine.step_s(64, 64 * 60)
    assert engine.step_s(64, 64 * 200) > engine.step_s(64, 64 * 60)  # longer contexts, a longer step
    assert engine.step_s(0, 0) == 0.0


def test_train_from_the_measured_curve_and_prefill_unshared_below_a_block():
    cal = _cal()
    assert train_step_s(cal, 9216) == pytest.approx(2.75)
    assert train_step_s(cal, 18432) == pytest.approx(5.0)  # past the last point: the last two's slope
    assert CpuEngine(cal, num_samples=8).prefill_s(20) == pytest.approx(8 * 20 * 1e-4)


def test_modes_of_bench_rollout_predicted_from_the_calibration():
    cfg = load_config([], ROLLOUT_DEFAULTS)
    predicted = predict_bench_rollout(_cal(), cfg, num_steps=3)
    assert set(predicted) == set(MODES)
    for p in predicted.values():
        assert p["step_s"] == pytest.approx(sum(p["phases"].values()))
        assert p["phases"]["sync"] == 0.4 and p["phases"]["switch"] == 0.6  # as measured
    # the cap and the early stop cut the tail: each is faster than running every answer to its end
    assert predicted["partial"]["rollout_s"] < predicted["none"]["rollout_s"]
    assert predicted["oversample_drop"]["rollout_s"] < predicted["none"]["rollout_s"]


def test_a_slower_machine_predicts_a_slower_rollout():
    cfg = load_config([], ROLLOUT_DEFAULTS)
    cal, slow = _cal(), _cal()
    cal.prefill_s_per_token = slow.prefill_s_per_token = 0.0  # the decode steps alone, twice as long
    slow.decode_step_s = [(b, c, 2 * s) for b, c, s in slow.decode_step_s]
    budgets = lambda n: [40] * n  # noqa: E731
    fast_s = predict_rollout(cal, cfg, budgets, num_steps=2)["rollout_s"]
    assert predict_rollout(slow, cfg, budgets, num_steps=2)["rollout_s"] == pytest.approx(2 * fast_s)


def test_modes_of_bench_async_predicted_overlapped_and_split():
    from colocate.bench.overlap import ASYNC_DEFAULTS
    from colocate.simulate.calibrate import predict_bench_async

    cfg = load_config([], ASYNC_DEFAULTS)
    cal, split = _cal(), _cal()
    cal.switch_s = split.switch_s = {}  # one_step_off's plan: nothing moved
    split.overlap_gain = 2.0  # sides that share nothing: the longer one is the step
    predicted = predict_bench_async(cal, split, cfg, num_steps=3)
    assert predicted["one_step_off"]["step_s"] == pytest.approx(predicted["sync"]["step_s"])  # time-sliced: 1.0
    ph = predicted["async_split"]["phases"]
    assert predicted["async_split"]["step_s"] == pytest.approx(max(ph["rollout"], ph["train"] + ph["sync"]))
    # async's step completes num_prompts groups, as sync's does, over as many segment passes as that takes: it
    # trains about as many tokens (the groups a pass completes first are the short ones, so not exactly)
    assert predicted["async"]["trained_tokens"] == pytest.approx(predicted["sync"]["trained_tokens"], rel=0.25)
    # both sides fighting over the cores (a gain below 1) cost more than running them in turn
    cal.overlap_gain = 0.8
    slowed = predict_bench_async(cal, split, cfg, num_steps=3)
    assert slowed["one_step_off"]["step_s"] == pytest.approx(predicted["sync"]["step_s"] / 0.8)


def test_an_old_calibration_without_the_overlap_gain_loads_as_time_sliced(tmp_path):
    data = {k: v for k, v in _cal().__dict__.items() if k != "overlap_gain"}
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Calibration.load(tmp_path / "old.json").overlap_gain == 1.0
