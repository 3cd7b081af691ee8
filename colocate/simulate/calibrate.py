"""`colocate simulate --calibrate [CONFIG] [key=value]`: this machine measured through the real stack, in a few
minutes, and saved as a Calibration (simulate/hardware.py) that `--calibration FILE` predicts with (simulate/cpu.py).

    cal = calibrate(cfg)                      # one Runtime of the job: engines, trainers, the sync
    cal.save(Path("benchmarks/results/simulate_cpu_calibration.json"))

What is measured, each on the job's own actors (job/runtime.py, as bench rollout starts them):
- the engine's decode step by running batch size: one pass of `b` answers of a fixed length (ignore_eos) per
  batch size, each engine step timed (engine/requests.py's timeline); the steps where all `b` run, split into
  their first and second halves, give the step at two context totals (the context term);
- prefill: the first step's excess over a decode step, per prompt token;
- the trainers' step by tokens: TrainerGroup.train_step on the job's sequence count at a few answer lengths;
- the switch as the controller runs it (job/controller.py: sleep, onload, release_grads, wake weights; offload,
  wake kv_cache) and the sync (runtime.sync.run()), each a few times, the median kept.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import ray

from colocate.config import JobConfig
from colocate.simulate.hardware import Calibration

BATCH_SIZES = (1, 8, 32, 64)
ANSWER_TOKENS = 96  # per answer in a decode pass: enough steps that a median holds on 2 busy cores
TRAIN_SEQUENCE_SCALES = (0.5, 1.0, 1.5)  # of the job's sequences a step
NUM_CYCLES = 2


def calibrate(cfg: JobConfig, *, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> Calibration:
    from colocate.bench.common import machine
    from colocate.job.runtime import Runtime

    with Runtime(cfg) as rt:
        prompt_tokens = _prompt_tokens(rt, cfg)
        limit = cfg.engine.max_num_seqs or max(batch_sizes)
        decode, prefill = _decode(rt, [b for b in batch_sizes if b <= limit], prompt_tokens)
        train = _train(rt, cfg, prompt_tokens)
        switch, sync = _switch_and_sync(rt)
    return Calibration(machine=machine(), decode_step_s=decode, train_step_s=train, sync_s=sync,
                       switch_s=switch, prefill_s_per_token=prefill, prompt_tokens=prompt_tokens,
                       num_engines=cfg.num_engines, max_num_seqs=limit)


def _prompt_tokens(rt, cfg: JobConfig) -> int:
    from colocate.rl.tasks import PromptStream, make_task

    samples = PromptStream(make_task(cfg.rollout.task, length=cfg.rollout.task_length),
                           seed=cfg.rollout.seed).next_batch(16)
    return round(statistics.fmean(len(rt.tokenizer(s.prompt, add_special_tokens=False).input_ids)
                                  for s in samples))


def _decode(rt, batch_sizes: list[int], prompt_tokens: int) -> tuple[list, float]:
    """(running, context total, seconds) rows, and prefill seconds per prompt token."""
    from colocate.engine.requests import EngineRequest

    engine, rows, prefill = rt.engines[0], [], []
    sampling = {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    for b in [batch_sizes[0]] + list(batch_sizes):  # the first pass warms the engine up, not kept
        requests = [EngineRequest(f"calibrate-{b}-{i}-{time.monotonic_ns()}", i, 0,
                                  [5 + (i * 7 + j) % 40 for j in range(prompt_tokens)], ANSWER_TOKENS, True,
                                  seed=i) for i in range(b)]
        timeline = ray.get(engine.run_pass.remote(requests, sampling))["timeline"]
        steps, previous = [], 0.0
        for t, n in timeline:
            steps.append((t - previous, n))
            previous = t
        full = [s for s, n in steps[1:] if n == b]  # the first step prefills
        if len(full) < 4:
            continue
        half = len(full) // 2
        for part, offset in ((full[:half], half / 2), (full[half:], half + (len(full) - half) / 2)):
            rows.append((b, round(b * (prompt_tokens + offset)), statistics.median(part)))
        prefill.append(max(0.0, steps[0][0] - statistics.median(full)) / (b * prompt_tokens))
    rows = sorted(set(rows[2:]))  # the warm-up pass's two rows dropped
    return rows, statistics.median(prefill[1:])


def _train(rt, cfg: JobConfig, prompt_tokens: int) -> list[tuple[int, float]]:
    """(tokens in the step, seconds): steps of half, all and one and a half times the job's sequences a step, their
    answer lengths drawn as bench rollout draws them (a long tail: the micro-batches' padding is the job's)."""
    from colocate.bench.rollout import lognormal_budgets
    from colocate.rl.samples import Sequence

    num = cfg.rollout.num_prompts * cfg.rollout.num_samples
    budgets = lognormal_budgets(cfg.rollout.max_tokens, seed=cfg.rollout.seed + 1)
    rows = []
    if rt.switch.trainer_offload:
        rt.trainers.onload()
    for count in (num // 2,) + TRAIN_SEQUENCE_SCALES:  # the first warms up, not kept
        lengths = budgets(None, max(1, round(count * num)) if isinstance(count, float) else count)
        seqs = [Sequence([5 + (i + k) % 40 for i in range(prompt_tokens)], [6 + (i * 7 + k) % 40 for i in range(n)],
                         [-2.0] * n, 1.0 if k % 2 == 0 else -1.0) for k, n in enumerate(lengths)]
        started = time.perf_counter()
        rt.trainers.train_step(seqs, cfg.trainer, step=0)
        rows.append((sum(prompt_tokens + n for n in lengths), time.perf_counter() - started))
        rt.trainers.release_grads()
    if rt.switch.trainer_offload:
        rt.trainers.offload()
    return sorted(rows[1:])


def _switch_and_sync(rt) -> tuple[dict[str, float], float]:
    """The switch's two halves as the controller runs them around train, and the sync between them."""
    level, offload = rt.switch.engine_sleep_level, rt.switch.trainer_offload
    to_train, to_sync, to_rollout, sync = [], [], [], []
    for _ in range(NUM_CYCLES):
        started = time.perf_counter()
        if level:
            rt.engines.sleep(level)
        if offload:
            rt.trainers.onload()
        to_train.append(time.perf_counter() - started)
        started = time.perf_counter()
        rt.trainers.release_grads()
        if level:
            rt.engines.wake(["weights"])
        to_sync.append(time.perf_counter() - started)
        started = time.perf_counter()
        rt.sync.run()
        sync.append(time.perf_counter() - started)
        started = time.perf_counter()
        if offload:
            rt.trainers.offload()
        if level:
            rt.engines.wake(["kv_cache"])
        to_rollout.append(time.perf_counter() - started)
    switch = {"to_train": statistics.median(to_train), "to_sync": statistics.median(to_sync),
              "to_rollout": statistics.median(to_rollout)}
    switch["seconds"] = sum(switch.values())
    return switch, statistics.median(sync)


def predict_bench_rollout(cal: Calibration, cfg: JobConfig, *, num_steps: int) -> dict[str, dict]:
    """bench rollout's modes (bench/rollout.py MODES) on its work (its lengths, its seed), by the CPU model."""
    from colocate.bench.rollout import MODES, lognormal_budgets
    from colocate.simulate.cpu import predict_rollout

    out = {}
    for mode, settings in MODES.items():
        budgets = lognormal_budgets(cfg.rollout.max_tokens, seed=cfg.rollout.seed)
        out[mode] = predict_rollout(cal, cfg, lambda n: budgets(None, n), num_steps=num_steps,
                                    partial_tokens=settings.get("partial_tokens", 0),
                                    oversample=settings.get("oversample", 1.0), max_lag=settings.get("max_lag", 1),
                                    leftover=settings.get("leftover", "carry"))
    return out


def predict_bench_async(cal: Calibration, split: Calibration, cfg: JobConfig, *, num_steps: int) -> dict[str, dict]:
    """bench async's modes (bench/overlap.py) by the CPU model: sync in turn; one_step_off and async (segments of
    a third of max_tokens, lag 2) co-located, time-sliced; async split, the longer of the engine's rollout (the
    split runtime's calibration: its engine alone on its slots) and its trainers' train + sync."""
    from colocate.bench.rollout import lognormal_budgets
    from colocate.simulate.cpu import overlapped_step_s, predict_rollout

    def run(c: Calibration, **keys) -> dict:
        budgets = lognormal_budgets(cfg.rollout.max_tokens, seed=cfg.rollout.seed)
        return predict_rollout(c, cfg, lambda n: budgets(None, n), num_steps=num_steps, **keys)

    segments = {"partial_tokens": -(-cfg.rollout.max_tokens // 3), "max_lag": 2}
    sync, overlapped, apart = run(cal), run(cal, **segments), run(split, **segments)
    one_step_off = {**sync, "step_s": overlapped_step_s(sync["phases"])}
    async_ = {**overlapped, "step_s": overlapped_step_s(overlapped["phases"])}
    ph = apart["phases"]
    async_split = {**apart, "step_s": max(ph["rollout"], ph["train"] + ph["sync"])}
    return {"sync": sync, "one_step_off": one_step_off, "async": async_, "async_split": async_split}


def run_calibrate(paths: list[str], overrides: list[str], *, out: Path, name: str, against: str, num_steps: int,
                  calibration: Path | None = None) -> dict:
    """`--calibrate`: measure the job (default: bench rollout's; bench async's with `--against async`) and save
    <out>/<name>_calibration.json; `--calibration FILE`: load it instead. `--against rollout|async`: then run that
    benchmark's work for real in the same session and write <out>/<name>.json, each mode's predicted and measured
    step (and rollout) side by side with their ratio. Async's split placement is a runtime of its own, calibrated
    apart (<name>_split_calibration.json)."""
    from colocate.bench.common import write_result
    from colocate.bench.overlap import ASYNC_DEFAULTS, split_config
    from colocate.bench.rollout import ROLLOUT_DEFAULTS
    from colocate.config import load_config
    from colocate.job.setup import check_job

    defaults = ASYNC_DEFAULTS if against == "async" else ROLLOUT_DEFAULTS
    cfg = load_config(paths, ([] if paths else defaults) + overrides)
    check_job(cfg)
    items = paths + ([] if paths else defaults) + overrides

    def measured_or_loaded(job: JobConfig, path: Path | None, suffix: str) -> tuple[Calibration, Path]:
        if path is not None:
            return Calibration.load(path), path
        started = time.perf_counter()
        cal = calibrate(job)
        cal.config = items
        path = out / f"{name}{suffix}_calibration.json"
        cal.save(path)
        print(f"calibrated in {time.perf_counter() - started:.0f} s: {path}")
        return cal, path

    cal, calibration = measured_or_loaded(cfg, calibration, "")
    result: dict = {"model": "colocate simulate's CPU model (simulate/cpu.py) from the calibration, a model",
                    "calibration": str(calibration)}
    if against == "async":
        split = split_config(cfg)
        split_path = calibration.with_name(calibration.name.replace("_calibration", "_split_calibration"))
        split_cal, split_path = measured_or_loaded(split, split_path if split_path.exists() else None, "_split")
        result["split_calibration"] = str(split_path)
        predicted = predict_bench_async(cal, split_cal, cfg, num_steps=num_steps - 1)  # its first step warms up
    else:
        predicted = predict_bench_rollout(cal, cfg, num_steps=num_steps)
    result["predicted"] = predicted
    if against == "rollout":
        from colocate.bench.rollout import run_rollout_bench

        measured = run_rollout_bench(cfg, num_steps=num_steps, out_dir=str(out), name=f"{name}_measured")["modes"]
        result["table"] = {mode: _compare(predicted[mode], measured[mode]) for mode in predicted}
    elif against == "async":
        from colocate.bench.overlap import run_async_bench

        measured = run_async_bench(cfg, num_steps=num_steps, out_dir=str(out), name=f"{name}_measured")["modes"]
        result["table"] = {mode: _compare(predicted[mode], measured[mode]) for mode in predicted}
    _print(predicted, result.get("table", {}))
    path = write_result(result, str(out), name)
    print(f"wrote {path}")
    return result


def _print(predicted: dict, table: dict) -> None:
    print(f"{'mode':<18} {'rollout s pred':>14} {'measured':>9} {'ratio':>6} {'step s pred':>12} {'measured':>9} "
          f"{'ratio':>6}")
    for mode, p in predicted.items():
        row = table.get(mode, {})
        measured = f"{row['rollout_s_measured']:9.2f} {row['rollout_ratio']:6.2f}" if "rollout_ratio" in row \
            else f"{'':9} {'':6}"
        step = f"{row['step_s_measured']:9.2f} {row['step_ratio']:6.2f}" if row else ""
        print(f"{mode:<18} {p['rollout_s']:14.2f} {measured} {p['step_s']:12.2f} {step}")


def _compare(predicted: dict, measured: dict) -> dict:
    """Step (and rollout, where the benchmark times it as a phase) predicted over measured."""
    row = {"step_s_predicted": predicted["step_s"], "step_s_measured": measured["step_s"],
           "step_ratio": predicted["step_s"] / measured["step_s"]}
    if "rollout_s" in measured:
        row.update(rollout_s_predicted=predicted["rollout_s"], rollout_s_measured=measured["rollout_s"],
                   rollout_ratio=predicted["rollout_s"] / measured["rollout_s"])
    return row
