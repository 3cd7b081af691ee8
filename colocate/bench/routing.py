"""`colocate bench routing`: what router replay (algo.router_replay, R3) does to the mismatch of a MoE model.

    colocate bench routing                          # bench-moe (4 layers of 32 experts, top-4), TP=2, 120 tokens

The engine samples answers at T=1 and captures every position's experts (engine/routing.py). The trainer then
scores every answer token twice in the same runtime: routing freely (its routers choose; each also records its
choice) and replaying the engine's experts. Each response token is classed by the position it is predicted from:
  flipped_here     the trainer's routers would send that position to other experts than the engine did, in at
                   least one layer (compared as sets)
  flipped_before   a flip at that position or any earlier one (attention carries an earlier flip forward)
  clean            no flip up to it
and per class the bench gives mean and max |log p_trainer - log p_engine| free and replayed, and the ratio's range.
Runs: a bf16 engine against a bf16 trainer (the production pair) and an fp32 one, and fp32 on both sides. Costs in
the same runs: the trainer's scored tokens a second free and replayed, and the engine's answer tokens a second with
the capture, against a runtime of its own without it (the bf16 pair's). Writes JSON.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from colocate.bench.common import BENCH_DEFAULTS, write_result
from colocate.bench.mismatch import Run, runtimes, sample, score
from colocate.config import JobConfig
from colocate.errors import ConfigError
from colocate.rl.samples import Sequence
from colocate.rl.tasks import PromptStream, make_task

ROUTING_DEFAULTS = [*BENCH_DEFAULTS, "model.preset=bench-moe", "algo.router_replay=true"]
RUNS = (Run("bfloat16", True), Run("bfloat16", False), Run("float32", False))
CLASSES = ("all", "flipped_here", "flipped_before", "clean")


def run_routing_bench(cfg: JobConfig, *, num_prompts: int, num_samples: int, max_tokens: int, out_dir: str,
                      name: str) -> dict:
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    samples = PromptStream(task, seed=cfg.rollout.seed).next_batch(num_prompts)
    sampling = {"n": num_samples, "temperature": 1.0, "top_p": 1.0, "seed": cfg.engine.seed, "routing": True}
    rows, skipped = [], []
    for run, runtime in runtimes(RUNS, cfg, skipped):
        with runtime as rt:
            prompts = [rt.tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples]
            budget = min(max_tokens, rt.cfg.engine.max_model_len - max(map(len, prompts)) - 1)
            row = {"engine_dtype": run.engine_dtype, "trainer_dtype": rt.trainer_info[0]["compute_dtype"],
                   "max_tokens": budget, **measure(rt, prompts, {**sampling, "max_tokens": budget})}
            rows.append(row)
    without = _engine_speed_without_capture(cfg, samples, {**sampling, "max_tokens": max_tokens})
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "engine_tp": cfg.engine.tp,
                         "expert_parallel": cfg.engine.expert_parallel, "num_prompts": num_prompts,
                         "num_samples": num_samples},
              "rows": rows, "engine_tokens_per_s_without_capture": without,
              **({"skipped": skipped} if skipped else {})}
    path = write_result(result, out_dir, name)
    _print(rows, without, path)
    return result


def measure(rt, prompts: list[list[int]], sampling: dict) -> dict:
    """One runtime's row: sample with the capture, score free and replayed, class every answer token."""
    sample(rt, prompts[:2], {**sampling, "max_tokens": 8})  # the first steps, untimed
    start = time.perf_counter()
    seqs = sample(rt, prompts, sampling)
    engine_s = time.perf_counter() - start
    free = [Sequence(s.prompt_ids, s.response_ids, s.logprobs, 0.0) for s in seqs]
    score(rt, seqs[:2])  # the trainer's first forward, untimed
    start = time.perf_counter()
    free_logprobs = score(rt, free)
    free_s, start = time.perf_counter() - start, time.perf_counter()
    replayed = score(rt, seqs)
    replay_s = time.perf_counter() - start
    own_routing = [own for _, own, _ in score(rt, free, method="score_routing")]  # untimed: it copies the choices
    classes = {c: [] for c in CLASSES}
    layer_flips, layer_rows = 0, 0
    for s, free_lp, own, replay_lp in zip(seqs, free_logprobs, own_routing, replayed):
        length = len(s.prompt_ids) + len(s.response_ids) - 1  # the positions the engine ran
        differs = (np.sort(own[:length], -1) != np.sort(s.routing[:length], -1)).any(-1)  # [positions, layers]
        layer_flips, layer_rows = layer_flips + int(differs.sum()), layer_rows + differs.size
        here = differs.any(-1)
        before = np.maximum.accumulate(here)
        for j, (engine, f, r) in enumerate(zip(s.logprobs, free_lp, replay_lp)):
            p = len(s.prompt_ids) + j - 1  # the position answer token j is predicted from
            token = (f - engine, r - engine)
            classes["all"].append(token)
            classes["flipped_here" if here[p] else "clean" if not before[p] else "flipped_before"].append(token)
            if here[p]:
                classes["flipped_before"].append(token)
    tokens = len(classes["all"])
    scored_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs)  # what each scoring pass computed
    return {"answer_tokens": tokens, "layer_flip_fraction": layer_flips / max(layer_rows, 1),
            "engine_tokens_per_s": tokens / engine_s,
            "trainer_tokens_per_s_free": scored_tokens / free_s,
            "trainer_tokens_per_s_replayed": scored_tokens / replay_s,
            "classes": {c: _stats(classes[c], tokens) for c in CLASSES}}


def _stats(tokens: list[tuple[float, float]], total: int) -> dict:
    if not tokens:
        return {"tokens": 0, "share": 0.0}
    d = np.asarray(tokens, dtype=np.float64)  # [tokens, (free, replayed)] log w
    out = {"tokens": len(d), "share": len(d) / total}
    for k, side in enumerate(("free", "replayed")):
        w = np.exp(d[:, k])
        out[side] = {"mean_abs": float(np.abs(d[:, k]).mean()), "max_abs": float(np.abs(d[:, k]).max()),
                     "ratio_min": float(w.min()), "ratio_max": float(w.max()),
                     "outside_1.1": float(((w < 1 / 1.1) | (w > 1.1)).mean())}
    return out


def _engine_speed_without_capture(cfg: JobConfig, samples, sampling: dict) -> float | None:
    """The bf16 pair's engine answer tokens a second with algo.router_replay off: the capture's cost."""
    job = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, router_replay=False))
    try:
        runtime = RUNS[0].runtime(job)
    except ConfigError as e:
        print(f"skipped the engine without capture: {e}")
        return None
    with runtime as rt:
        prompts = [rt.tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples]
        budget = min(sampling["max_tokens"], rt.cfg.engine.max_model_len - max(map(len, prompts)) - 1)
        sample(rt, prompts[:2], {**sampling, "max_tokens": 8})
        start = time.perf_counter()
        seqs = sample(rt, prompts, {**sampling, "max_tokens": budget})
        return sum(len(s.response_ids) for s in seqs) / (time.perf_counter() - start)


def _print(rows: list[dict], without: float | None, path) -> None:
    print(f"{'engine/trainer':<20} {'class':<15} {'share':>6} {'free mean|max':>20} {'replayed mean|max':>20}")
    for row in rows:
        pair = f"{row['engine_dtype'][:4]}/{row['trainer_dtype'][:4]}"
        for c, s in row["classes"].items():
            if not s["tokens"]:
                continue
            print(f"{pair:<20} {c:<15} {s['share']:>6.1%} "
                  f"{s['free']['mean_abs']:>9.2e} {s['free']['max_abs']:>9.2e}  "
                  f"{s['replayed']['mean_abs']:>9.2e} {s['replayed']['max_abs']:>9.2e}")
        print(f"{pair:<20} engine {row['engine_tokens_per_s']:.0f} tok/s with the capture; trainer "
              f"{row['trainer_tokens_per_s_free']:.0f} free, {row['trainer_tokens_per_s_replayed']:.0f} replayed")
    if without is not None:
        print(f"engine without the capture (bf16 pair): {without:.0f} tok/s")
    print(f"wrote {path}")
