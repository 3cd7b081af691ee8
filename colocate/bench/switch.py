"""`colocate bench switch`: the cost of switching memory between the engine and the trainer, in one run.

    colocate bench switch                      # bench preset on the CPU (24 layers, >= 0.4 GB bf16, TP=2)
    colocate bench switch configs/default.yaml --repeats 3

Measured over N cycles on the same engine and trainers:
- engine sleep at level 1 and 2, wake by tag (weights, then the sync, then kv_cache), and the memory each frees
  (engine workers' RSS, against the weights + KV cache they hold); generations before sleep and after wake
  compared token for token. Level 1 keeps a host copy of the weights; on the CPU that copy sits in the same RAM,
  so what level 1 frees there is the KV cache (the RSS drop says so, nothing is subtracted or added);
- trainer offload / onload of parameters and optimizer state, and the RSS it frees;
- floor: a single-process memcpy of the engine's weight bytes;
- the alternative without sleep mode: shutting the engine down and starting it again (plus the sync that gives
  it the trained weights);
- the memory preflight against the job's measured memory (PSS, per phase: bench/peaks.py), like with like: the
  preflight pictures the longest sequences the config allows (a PROMPT_TOKENS prompt and rollout.max_tokens of
  answer in every row), while the two steps train the task's own, a few tokens each. So the train phase is
  predicted for the sequences the steps trained (the job with its prompt and answer bounds at the longest it
  ran: `as_run`), and the config's bound is kept beside it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import ray

from colocate.bench.common import memcpy_floor_s, summary, write_result
from colocate.bench.peaks import PhaseSampler, compare
from colocate.config import JobConfig
from colocate.job.controller import Controller
from colocate.job.placement import sleep_backend
from colocate.job.preflight import model_dims, predict_phases, train_micro_batch_shape
from colocate.job.runtime import Runtime

PROMPTS = [[5, 6, 7, 16], [8, 9, 16]]
SAMPLING = {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "seed": 7}


def run_switch_bench(cfg: JobConfig, *, num_cycles: int, out_dir: str, name: str) -> dict:
    sampler = PhaseSampler().start()
    try:
        with Runtime(cfg) as rt:
            # two real steps, as `colocate launch` runs them, with the job's memory sampled per phase; after
            # them the optimizer has its state and the engine its trained weights
            controller = Controller(cfg, rt)
            sampler.follow(controller)
            trained = _record_trained(controller)
            controller.run_steps(2)
            sampler.stop()
            ran = as_run(cfg, trained)
            predicted = predict_phases(ran, model_dims(cfg), device=rt.device, plan=rt.switch)
            bound = predict_phases(cfg, model_dims(cfg), device=rt.device, plan=rt.switch)
            result = _measure(cfg, rt, num_cycles)
    finally:
        sampler.stop()
    result["preflight"] = compare(predicted, sampler)
    result["preflight"]["trained"] = {
        "sequences": len(trained), "longest_prompt": ran.data.max_prompt_tokens,
        "longest_answer": ran.rollout.max_tokens, "micro_batch_shape": train_micro_batch_shape(ran, rt.device),
        "config_micro_batch_shape": train_micro_batch_shape(cfg, rt.device),
        "config_bound": {p.name: p.total for p in bound}}
    ratios = result["ratios"]
    ratios["preflight_peak_predicted_over_measured"] = result["preflight"]["peak_predicted_over_measured"]
    ratios["preflight_train_predicted_over_measured"] = result["preflight"]["phases"]["train"][
        "predicted_over_measured"]
    path = write_result(result, out_dir, name)
    _plot(result, Path(out_dir) / f"{name}.png")
    _print(result, path)
    return result


def _record_trained(controller: Controller) -> list[tuple[int, int]]:
    """(prompt, answer) tokens of every sequence the controller trains from here on (its train phase, observed)."""
    trained, train = [], controller.train

    def recording(scored, step: int) -> dict:
        trained.extend((len(s.prompt_ids), len(s.response_ids)) for s in scored.sequences)
        return train(scored, step)

    controller.train = recording
    return trained


def as_run(cfg: JobConfig, trained: list[tuple[int, int]]) -> JobConfig:
    """The job whose preflight pictures the sequences `trained`: prompts and answers bounded at their longest."""
    if not trained:
        return cfg
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, max_prompt_tokens=max(p for p, _ in trained)),
        rollout=dataclasses.replace(cfg.rollout, max_tokens=max(a for _, a in trained)))


def _measure(cfg: JobConfig, rt: Runtime, num_cycles: int) -> dict:
    engine = rt.engines[0]
    ray.get(engine.sleep.remote(rt.switch.engine_sleep_level or 2))
    ray.get(engine.wake.remote(["weights", "kv_cache"], True))
    rt.sync.run()
    memory = ray.get(engine.memory.remote())
    weight_bytes = sum(w["weight_bytes"] for w in memory)
    held = weight_bytes + sum(w["kv_cache_bytes"] for w in memory)
    floor_s = memcpy_floor_s(weight_bytes, device=rt.device)  # on the device that does the work
    levels = {level: _engine_cycles(rt, level, num_cycles, held) for level in (1, 2)}
    trainer = _trainer_cycles(rt, num_cycles)
    started = time.perf_counter()
    rt.restart_engines()
    rt.sync.run()
    restart_s = time.perf_counter() - started

    switch = {level: m["sleep"]["median_s"] + m["wake_weights"]["median_s"] + m["wake_kv_cache"]["median_s"]
              for level, m in levels.items()}
    result = {
        "config": {"model": cfg.model.preset or cfg.model.path, "engine_dtype": cfg.engine.dtype,
                   "engine_tp": cfg.engine.tp, "kv_cache_gib_per_worker": cfg.engine.kv_cache_gib,
                   "sleep_backend": sleep_backend(cfg, rt.device),
                   "sleep_level_of_the_job": rt.switch.engine_sleep_level,
                   "enforce_eager": cfg.engine.enforce_eager},
        "engine_weight_bytes": weight_bytes,
        "engine_held_bytes": held,
        "floor_memcpy_s": floor_s,
        "engine_level1": levels[1],
        "engine_level2": levels[2],
        "trainer": trainer,
        "engine_restart_plus_sync_s": restart_s,
        "ratios": {
            "level1_freed_fraction": levels[1]["freed_fraction_median"],
            "level2_freed_fraction": levels[2]["freed_fraction_median"],
            "trainer_freed_fraction": trainer["freed_fraction_median"],
            "level1_wake_over_floor": levels[1]["wake_weights"]["median_s"] / floor_s,
            "level2_wake_plus_sync_over_level1_wake_plus_sync":
                (levels[2]["wake_weights"]["median_s"] + levels[2]["sync"]["median_s"])
                / (levels[1]["wake_weights"]["median_s"] + levels[1]["sync"]["median_s"]),
            "restart_over_level2_switch": restart_s / (switch[2] + levels[2]["sync"]["median_s"]),
            "restart_over_level1_switch": restart_s / (switch[1] + levels[1]["sync"]["median_s"]),
        },
    }
    return result


def _engine_cycles(rt: Runtime, level: int, num_cycles: int, held: int) -> dict:
    engine = rt.engines[0]
    times = {k: [] for k in ("sleep", "wake_weights", "sync", "wake_kv_cache")}
    freed, identical = [], []
    for _ in range(num_cycles):
        before = ray.get(engine.generate.remote(PROMPTS, SAMPLING))
        awake = sum(w["rss_bytes"] for w in ray.get(engine.memory.remote()))
        times["sleep"].append(_timed(lambda: ray.get(engine.sleep.remote(level))))
        freed.append(awake - sum(w["rss_bytes"] for w in ray.get(engine.memory.remote())))
        times["wake_weights"].append(_timed(lambda: ray.get(engine.wake.remote(["weights"]))))
        times["sync"].append(_timed(rt.sync.run))
        # commit: pages resident again, as after a CUDA wake, so every cycle measures a full engine
        times["wake_kv_cache"].append(_timed(lambda: ray.get(engine.wake.remote(["kv_cache"], True))))
        identical.append(ray.get(engine.generate.remote(PROMPTS, SAMPLING)) == before)
    return {**{k: summary(v) for k, v in times.items()}, "freed_bytes": freed,
            "freed_fraction_median": statistics.median(freed) / held, "generation_identical_after_wake": all(identical)}


def _trainer_cycles(rt: Runtime, num_cycles: int) -> dict:
    offload, onload, freed, moved = [], [], [], []
    for _ in range(num_cycles):
        ray.get([t.onload.remote() for t in rt.trainers])
        rss = sum(ray.get([t.rss_bytes.remote() for t in rt.trainers]))
        started = time.perf_counter()
        moved.append(sum(ray.get([t.offload.remote() for t in rt.trainers])))
        offload.append(time.perf_counter() - started)
        freed.append(rss - sum(ray.get([t.rss_bytes.remote() for t in rt.trainers])))
        onload.append(_timed(lambda: ray.get([t.onload.remote() for t in rt.trainers])))
    ray.get([t.offload.remote() for t in rt.trainers])  # as the controller leaves them before a rollout
    return {"offload": summary(offload), "onload": summary(onload), "state_bytes": moved[0], "freed_bytes": freed,
            "freed_fraction_median": statistics.median(freed) / max(moved[0], 1)}


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for level in (1, 2):
        m = result[f"engine_level{level}"]
        for key in ("sleep", "wake_weights", "sync", "wake_kv_cache"):
            labels.append(f"L{level} {key}")
            values.append(m[key]["median_s"] * 1e3)
    for key in ("offload", "onload"):
        labels.append(f"trainer {key}")
        values.append(result["trainer"][key]["median_s"] * 1e3)
    labels += ["memcpy floor", "engine restart + sync"]
    values += [result["floor_memcpy_s"] * 1e3, result["engine_restart_plus_sync_s"] * 1e3]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.barh(labels, values, color=["tab:blue"] * 8 + ["tab:green"] * 2 + ["tab:gray", "tab:red"])
    ax.set_xscale("log")
    ax.set_xlabel("ms (median, log scale)")
    ax.set_title("memory switching: engine sleep/wake by level, trainer offload, vs floor and restart")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print(result: dict, path: Path) -> None:
    r = result["ratios"]
    print(f"engine weights {result['engine_weight_bytes'] / 1e6:.0f} MB, + KV cache = "
          f"{result['engine_held_bytes'] / 1e6:.0f} MB | floor (memcpy) {result['floor_memcpy_s'] * 1e3:.1f} ms")
    for level in (1, 2):
        m = result[f"engine_level{level}"]
        print(f"level {level}: sleep {m['sleep']['median_s'] * 1e3:.1f} ms, wake weights "
              f"{m['wake_weights']['median_s'] * 1e3:.1f} ms, sync {m['sync']['median_s'] * 1e3:.1f} ms, wake kv "
              f"{m['wake_kv_cache']['median_s'] * 1e3:.1f} ms | freed {m['freed_fraction_median']:.1%} | identical "
              f"generation {m['generation_identical_after_wake']}")
    t = result["trainer"]
    print(f"trainer: offload {t['offload']['median_s'] * 1e3:.1f} ms, onload {t['onload']['median_s'] * 1e3:.1f} ms "
          f"| freed {t['freed_fraction_median']:.1%} of {t['state_bytes'] / 1e6:.0f} MB")
    print(f"engine restart + sync {result['engine_restart_plus_sync_s']:.1f} s = "
          f"{r['restart_over_level2_switch']:.0f}x a level-2 switch + sync | level-1 wake / floor "
          f"{r['level1_wake_over_floor']:.2f}x | level-2 (wake + sync) / level-1 (wake + sync) "
          f"{r['level2_wake_plus_sync_over_level1_wake_plus_sync']:.2f}")
    pf = result["preflight"]
    phases = ", ".join(f"{name} {row['predicted_bytes'] / 2**30:.2f}/{(row['measured_bytes'] or 0) / 2**30:.2f}"
                       for name, row in pf["phases"].items())
    trained = pf["trained"]
    print(f"preflight, predicted/measured GiB (whole job, PSS), for the {trained['sequences']} sequences trained "
          f"(prompts <= {trained['longest_prompt']}, answers <= {trained['longest_answer']} tokens): {phases} | "
          f"peak {pf['peak_predicted_bytes'] / 2**30:.2f}/{pf['peak_measured_bytes'] / 2**30:.2f} = "
          f"{pf['peak_predicted_over_measured']:.2f}; the config's bound, train "
          f"{trained['config_bound']['train'] / 2**30:.2f}")
    print(f"results: {path} (+ .png)")
