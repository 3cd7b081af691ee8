"""`colocate bench sync`: weight sync time against the memcpy floor and two baselines, in one run.

    colocate bench sync                                   # bench preset: 24 layers, >= 0.4 GB bf16, TP=2, CPU
    colocate bench sync configs/default.yaml --repeats 10

Measured side by side on the same trainers and engine:
- colocate: the sliced, pipelined sync (each FSDP2 rank writes its rows of each worker's TP slice straight into
  the worker's ring region; workers copy into their parameters);
- baseline "first version": full HF tensors through the ring, sliced by vLLM's `load_weights`;
- baseline "naive": the whole state dict gathered on rank 0, shipped through Ray's object store, loaded with
  `load_weights`;
- floor: one single-process memcpy of the engine's weight bytes.
Every method is verified afterwards: each worker's parameters equal the trainer's after the cast.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray

from colocate.bench.common import memcpy_floor_s, summary, write_result
from colocate.config import JobConfig
from colocate.runtime import Runtime
from colocate.sync.weight_sync import WeightSync


def run_sync_bench(cfg: JobConfig, *, num_syncs: int, num_warmup: int, out_dir: str, name: str) -> dict:
    with Runtime(cfg) as rt:
        worker_memory = [w for e in ray.get([e.memory.remote() for e in rt.engines]) for w in e]
        engine_bytes = sum(w["weight_bytes"] for w in worker_memory)
        floor_s = memcpy_floor_s(engine_bytes)
        pids = ray.get([t.pid.remote() for t in rt.trainers]) + [w["pid"] for w in worker_memory]

        specs = ray.get(rt.trainers[0].param_specs.remote(cfg.engine.dtype))
        first = WeightSync(rt.trainers, rt.engines, specs, cfg=cfg.sync, hf_config=rt.sync.hf_config, sliced=False)
        first.open()
        # Interleaved (colocate, first version, colocate, ...): drift on a shared machine hits both alike.
        colocate, first_version = _time_syncs([rt.sync, first], num_syncs, num_warmup, pids)
        first_version["verified_equal"] = first.verify_full(cfg.engine.dtype) == []
        rt.sync.run()  # the breakdown comes from colocate's own last sync
        colocate["breakdown"] = _breakdown(rt)
        colocate["verified_equal"] = rt.sync.verify_full(cfg.engine.dtype) == []

        naive = _time_naive(rt, num_syncs, num_warmup, cfg.engine.dtype)
        naive["verified_equal"] = rt.sync.verify_full(cfg.engine.dtype) == []
        plan = rt.sync.plan
        # one ring per engine worker (sliced plan); the CPU full-tensor plan shares one ring per engine
        ring_bytes = plan.ring_bytes * len(rt.engines) * (cfg.engine.tp if plan.mode == "sliced" else 1)

    result = {
        "config": {"model": cfg.model.preset or cfg.model.path, "engine_dtype": cfg.engine.dtype,
                   "engine_tp": cfg.engine.tp, "num_slots": cfg.placement.num_slots,
                   "bucket_slot_bytes": plan.slot_bytes, "num_bucket_slots": plan.num_slots,
                   "num_buckets": len(plan.buckets), "plan_mode": plan.mode, "verify": cfg.sync.verify,
                   "enforce_eager": cfg.engine.enforce_eager},
        "engine_weight_bytes": engine_bytes,
        "floor_memcpy_s": floor_s,
        "colocate": colocate,
        "baseline_first_version": first_version,
        "baseline_naive": naive,
        "ratios": {
            "colocate_over_floor": colocate["median_s"] / floor_s,
            "first_version_over_floor": first_version["median_s"] / floor_s,
            "naive_over_floor": naive["median_s"] / floor_s,
            "speedup_vs_naive": naive["median_s"] / colocate["median_s"],
            "speedup_vs_first_version": first_version["median_s"] / colocate["median_s"],
            "ring_bytes_over_model_bytes": ring_bytes / engine_bytes,
        },
        "ring_bytes": ring_bytes,
        "ring_bytes_per_worker": plan.ring_bytes,
    }
    path = write_result(result, out_dir, name)
    _plot(colocate["breakdown"], plan, Path(out_dir) / f"{name}.png")
    _print(result, path)
    return result


def _time_syncs(syncs: list[WeightSync], num_syncs: int, num_warmup: int, pids: list[int]) -> list[dict]:
    """Time each sync method `num_syncs` times, interleaved, after `num_warmup` untimed runs of each."""
    for _ in range(num_warmup):
        for sync in syncs:
            sync.run()
    _reset_peak_rss(pids)
    before = {pid: _status_kib(pid, "VmRSS") for pid in pids}
    stats: list[list[dict]] = [[] for _ in syncs]
    for _ in range(num_syncs):
        for sync, collected in zip(syncs, stats):
            collected.append(sync.run())
    peak = {pid: _status_kib(pid, "VmHWM") - before[pid] for pid in pids}
    results = []
    for collected in stats:
        phases = {k: sum(s[k] for s in collected) / len(collected)
                  for k in ("sync_load_s", "sync_verify_s", "sync_post_s")}
        results.append({**summary([s["sync_s"] for s in collected]), "phases_mean_s": phases})
    # Per process, what its RSS peaked at above its steady state during all the timed syncs. Pages of a shared
    # ring count in every process that touched them, so the sum over-counts the rings.
    results[0]["peak_rss_over_steady_bytes"] = {str(pid): kib * 1024 for pid, kib in peak.items()}
    return results


def _time_naive(rt: Runtime, num_syncs: int, num_warmup: int, dtype: str) -> dict:
    times = []
    for i in range(num_warmup + num_syncs):
        started = time.perf_counter()
        states = [t.full_state_dict.remote(dtype, rank0_only=True) for t in rt.trainers]
        ray.get([e.load_state.remote(states[0]) for e in rt.engines] + states[1:])
        if i >= num_warmup:
            times.append(time.perf_counter() - started)
    return summary(times)


def _breakdown(rt: Runtime) -> dict:
    """Per bucket: the trainers' write (gather + cast + pack, slowest rank) and the workers' verify and load,
    from the last sync."""
    writes: dict[int, float] = {}
    for rank_times in ray.get([t.take_write_times.remote() for t in rt.trainers]):
        last = rank_times[-len(rt.sync.plan.buckets) * len(rt.engines):]
        for index, seconds in last:
            writes[index] = max(writes.get(index, 0.0), seconds)
    buckets = rt.sync.last_buckets
    return {"group": [b.group for b in rt.sync.plan.buckets],
            "write_s": [writes.get(i, 0.0) for i in range(len(buckets))],
            "verify_s": [b["verify_s"] for b in buckets],
            "load_s": [b["load_s"] for b in buckets],
            "transfer_s": [0.0] * len(buckets),  # shared memory: the write is the transfer
            "bytes": [b.num_bytes for b in rt.sync.plan.buckets]}


def _reset_peak_rss(pids: list[int]) -> None:
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _plot(breakdown: dict, plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(breakdown["group"]))
    fig, ax = plt.subplots(figsize=(12, 4))
    bottom = [0.0] * len(breakdown["group"])
    for key, color in (("write_s", "tab:blue"), ("verify_s", "tab:orange"), ("load_s", "tab:green")):
        values = [v * 1e3 for v in breakdown[key]]
        ax.bar(x, values, bottom=bottom, color=color, label=key.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(x), breakdown["group"], rotation=90, fontsize=7)
    ax.set_ylabel("ms per bucket")
    ax.set_title(f"weight sync per layer and phase ({plan.mode} plan, {plan.num_slots}-slot ring; write of bucket "
                 "i+1 overlaps load of bucket i)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print(result: dict, path: Path) -> None:
    r = result["ratios"]
    mb = result["engine_weight_bytes"] / 1e6
    print(f"engine weights {mb:.0f} MB | floor (memcpy) {result['floor_memcpy_s'] * 1e3:.1f} ms")
    for key, label in (("colocate", "colocate"), ("baseline_first_version", "first version"),
                       ("baseline_naive", "naive")):
        m = result[key]
        print(f"{label:>14}: median {m['median_s'] * 1e3:8.1f} ms (min {m['min_s'] * 1e3:.1f}, max "
              f"{m['max_s'] * 1e3:.1f}) | {m['median_s'] / result['floor_memcpy_s']:.2f}x floor | verified "
              f"{m['verified_equal']}")
    print(f"speedup vs naive {r['speedup_vs_naive']:.1f}x, vs first version {r['speedup_vs_first_version']:.2f}x | "
          f"rings {result['ring_bytes'] / 1e6:.1f} MB in all ({result['ring_bytes_per_worker'] / 1e6:.1f} MB per worker) "
          f"= {r['ring_bytes_over_model_bytes']:.1%} of the weights")
    print(f"results: {path} (+ .png)")
