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
REPEATS = 3  # of each decode sweep and train step, the median kept
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True}  # every answer its full length


def calibrate(cfg: JobConfig, *, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> Calibration:
    from colocate.job.runtime import Runtime

    with Runtime(cfg) as rt:
        return measure(rt, cfg, batch_sizes=batch_sizes)


def measure(rt, cfg: JobConfig, *, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> Calibration:
    """The job's runtime `rt` measured, from the state a job starts in (engines awake, trainers as the plan
    keeps them between steps) back to it."""
    from colocate.bench.common import machine

    prompt_tokens = _prompt_tokens(rt, cfg)
    limit = cfg.engine.max_num_seqs or max(batch_sizes)
    batches = [b for b in batch_sizes if b <= limit]
    decode, prefill, pass_s = _decode(rt, batches, prompt_tokens)
    if rt.switch.trainer_offload:  # resident for its steps, and beside the engine for the overlap's
        rt.trainers.onload()
    train = _train(rt, cfg, prompt_tokens)
    gain = _overlap_gain(rt, cfg, prompt_tokens, batches[-1])
    if rt.switch.trainer_offload:
        rt.trainers.offload()
    switch, sync = _switch_and_sync(rt)
    return Calibration(machine=machine(), decode_step_s=decode, train_step_s=train, sync_s=sync,
                       switch_s=switch, prefill_s_per_token=prefill, prompt_tokens=prompt_tokens,
                       num_engines=cfg.num_engines, max_num_seqs=limit, overlap_gain=gain, pass_s=pass_s)


def _prompt_tokens(rt, cfg: JobConfig) -> int:
    from colocate.rl.tasks import PromptStream

    # the runtime's own task (job/setup.py: built once a job, which test_runtime counts)
    samples = PromptStream(rt.setup.task, seed=cfg.rollout.seed).next_batch(16)
    return round(statistics.fmean(len(rt.tokenizer(s.prompt, add_special_tokens=False).input_ids)
                                  for s in samples))


def _decode_requests(tag: str, batch: int, prompt_tokens: int) -> list:
    """`batch` answers of ANSWER_TOKENS each (ignore_eos), from prompts of the job's length."""
    from colocate.engine.requests import EngineRequest

    return [EngineRequest(f"{tag}-{batch}-{i}-{time.monotonic_ns()}", i, 0,
                          [5 + (i * 7 + j) % 40 for j in range(prompt_tokens)], ANSWER_TOKENS, True, seed=i)
            for i in range(batch)]


def _decode(rt, batch_sizes: list[int], prompt_tokens: int) -> tuple[list, float, float]:
    """(running, context total, seconds) rows, prefill seconds per prompt token, and a pass's wall time beyond its
    steps (the call, its requests in, its results out: a pass of partial rollout's or async's pays it each time,
    one of algo.mode=async's steps several times): after a warm-up pass at the
    largest batch, REPEATS sweeps over the batch sizes, each row the median of its sweeps (one pass of a 2-core
    machine's decode steps is seen drifting by 4x between its halves)."""
    engine, halves, prefill, beside = rt.engines[0], {}, [], []
    ray.get(engine.run_pass.remote(_decode_requests("warm-up", batch_sizes[-1], prompt_tokens), SAMPLING))
    for _ in range(REPEATS):
        for b in batch_sizes:
            started = time.perf_counter()
            timeline = ray.get(engine.run_pass.remote(_decode_requests("calibrate", b, prompt_tokens), SAMPLING))
            beside.append(time.perf_counter() - started - timeline["timeline"][-1][0])
            steps, previous = [], 0.0
            for t, n in timeline["timeline"]:
                steps.append((t - previous, n))
                previous = t
            full = [s for s, n in steps[1:] if n == b]  # the first step prefills
            if len(full) < 4:
                continue
            half = len(full) // 2
            for k, (part, offset) in enumerate(((full[:half], half / 2), (full[half:], half + (len(full) - half) / 2))):
                halves.setdefault((b, k), []).append((b * (prompt_tokens + offset), statistics.median(part)))
            prefill.append(max(0.0, steps[0][0] - statistics.median(full)) / (b * prompt_tokens))
    rows = sorted((b, round(statistics.fmean(c for c, _ in runs)), statistics.median(s for _, s in runs))
                  for (b, _), runs in halves.items())
    return rows, statistics.median(prefill), max(0.0, statistics.median(beside))


def _sequences(cfg: JobConfig, prompt_tokens: int, count: int) -> list:
    """`count` sequences of the job's prompt length, their answer lengths drawn as bench rollout draws them (a long
    tail: the micro-batches' padding is the job's)."""
    from colocate.bench.rollout import lognormal_budgets
    from colocate.rl.samples import Sequence

    lengths = lognormal_budgets(cfg.rollout.max_tokens, seed=cfg.rollout.seed + count)(None, count)
    return [Sequence([5 + (i + k) % 40 for i in range(prompt_tokens)], [6 + (i * 7 + k) % 40 for i in range(n)],
                     [-2.0] * n, 1.0 if k % 2 == 0 else -1.0) for k, n in enumerate(lengths)]


def _train(rt, cfg: JobConfig, prompt_tokens: int) -> list[tuple[int, float]]:
    """(tokens in the step, seconds): steps of half, all and one and a half times the job's sequences a step."""
    num = cfg.rollout.num_prompts * cfg.rollout.num_samples
    for _ in range(2):  # warm-up, not kept: the first steps after the start are seen 1.5x slower
        _train_once(rt, cfg, _sequences(cfg, prompt_tokens, num))
    rows = []
    for scale in TRAIN_SEQUENCE_SCALES:
        seqs = _sequences(cfg, prompt_tokens, max(1, round(scale * num)))
        seconds = statistics.median(_train_once(rt, cfg, seqs) for _ in range(REPEATS))
        rows.append((sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs), seconds))
    return sorted(rows)


def _train_once(rt, cfg: JobConfig, seqs: list) -> float:
    started = time.perf_counter()
    rt.trainers.train_step(seqs, cfg.trainer, step=0)
    seconds = time.perf_counter() - started
    rt.trainers.release_grads()
    return seconds


MAX_OVERLAP_GAIN = 2.0  # two sides, each at most its alone speed


def _overlap_gain(rt, cfg: JobConfig, prompt_tokens: int, batch: int) -> float:
    """A decode pass of `batch` answers on every engine beside a train step of the job's sequences, against each
    alone: the alone-seconds of work done a second while both ran (the first to finish did all of its own; the
    other, its alone time less what it ran by itself after). One-step-off, async and, on one machine, split run
    both at once; on a GPU the same ratio is the time-slicing gain (an H200: 0.99). The median of NUM_CYCLES."""
    from colocate.rollout.overlap import Background

    seqs = _sequences(cfg, prompt_tokens, cfg.rollout.num_prompts * cfg.rollout.num_samples)

    def decode() -> list:
        return [e.run_pass.remote(_decode_requests(f"overlap-{e_i}", batch, prompt_tokens), SAMPLING)
                for e_i, e in enumerate(rt.engines)]

    gains = []
    for _ in range(NUM_CYCLES):
        started = time.perf_counter()
        ray.get(decode())
        decode_alone = time.perf_counter() - started
        train_alone = _train_once(rt, cfg, seqs)
        started = time.perf_counter()
        passes = decode()
        training = Background(rt.trainers.train_step, seqs, cfg.trainer, step=0)
        ray.get(passes)
        decode_end = time.perf_counter() - started
        training.wait()
        train_end = training.finished_at - started
        rt.trainers.release_grads()
        first = min(decode_end, train_end)
        alone_after = max(decode_end, train_end) - first  # the later one, by itself, at its own speed
        gains.append(max(0.05, (decode_alone + train_alone - alone_after) / first))
    # Two sides at once do at most both sides' work: a ratio above 2 is another process slowing the runs alone
    # (seen: 4.17 in a loaded CI run, beside another test file), not a gain
    return min(MAX_OVERLAP_GAIN, statistics.median(gains))


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
    a third of max_tokens, lag 2, a step the passes that complete num_prompts groups) at once, at the overlap gain
    the calibration measured; async split the same from the split runtime's calibration (its engines on their
    slots, its trainers on theirs: on one machine, the same cores)."""
    from colocate.bench.rollout import lognormal_budgets
    from colocate.simulate.cpu import overlapped_step_s, predict_rollout

    def run(c: Calibration, **keys) -> dict:
        budgets = lognormal_budgets(cfg.rollout.max_tokens, seed=cfg.rollout.seed)
        return predict_rollout(c, cfg, lambda n: budgets(None, n), num_steps=num_steps, **keys)

    segments = {"partial_tokens": -(-cfg.rollout.max_tokens // 3), "max_lag": 2, "whole": True}
    sync, overlapped, apart = run(cal), run(cal, **segments), run(split, **segments)
    one_step_off = {**sync, "step_s": overlapped_step_s(cal, sync["phases"])}
    async_ = {**overlapped, "step_s": overlapped_step_s(cal, overlapped["phases"])}
    async_split = {**apart, "step_s": overlapped_step_s(split, apart["phases"])}
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
    cfg = check_job(load_config(paths, ([] if paths else defaults) + overrides)).config
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

        measured = run_async_bench(cfg, num_steps=num_steps, out_dir=str(out), name=f"{name}_measured",
                                   variants=list(predicted))["modes"]  # the modes the simulator predicts
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
