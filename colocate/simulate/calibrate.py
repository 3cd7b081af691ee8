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

import dataclasses
import statistics
import time

import ray

from colocate.config import JobConfig
from colocate.simulate.hardware import Calibration

BATCH_SIZES = (1, 4, 16, 32, 64)
ANSWER_TOKENS = 40  # per answer in a decode pass: bench rollout's median
TRAIN_ANSWER_LENGTHS = (8, 40, 120)
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
    return Calibration(machine=machine(), decode_step_s=decode, train_tokens_per_s=train, sync_s=sync,
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
    """(tokens in the step, seconds) at the job's sequences per step, a few answer lengths."""
    from colocate.rl.samples import Sequence

    num = cfg.rollout.num_prompts * cfg.rollout.num_samples
    rows = []
    if rt.switch.trainer_offload:
        rt.trainers.onload()
    for n in (TRAIN_ANSWER_LENGTHS[0],) + TRAIN_ANSWER_LENGTHS:  # the first warms up, not kept
        seqs = [Sequence([5 + (i + k) % 40 for i in range(prompt_tokens)], [6 + (i * 7 + k) % 40 for i in range(n)],
                         [-2.0] * n, 1.0 if k % 2 == 0 else -1.0) for k in range(num)]
        started = time.perf_counter()
        rt.trainers.train_step(seqs, cfg.trainer, step=0)
        rows.append((num * (prompt_tokens + n), time.perf_counter() - started))
        rt.trainers.release_grads()
    if rt.switch.trainer_offload:
        rt.trainers.offload()
    return rows[1:]


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


def as_dict(cal: Calibration) -> dict:
    return dataclasses.asdict(cal)
