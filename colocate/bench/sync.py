"""`colocate bench sync`: weight sync time against the memcpy floor and two baselines, in one run.

    colocate bench sync                                   # bench preset: 24 layers, >= 0.4 GB bf16, TP=2, CPU
    colocate bench sync configs/default.yaml --repeats 10

Measured side by side on the same trainers and engine:
- colocate: the job's own sync (`sync.transport=auto`): on the CPU in place, each FSDP2 rank casting its rows of
  each worker's TP slice straight into the worker's parameters (kept in shared memory);
- ring: the sliced, pipelined ring the CUDA path runs (ranks write TP slices into ring slots, workers verify
  and copy into their parameters), run here on the CPU;
- baseline "first version": full HF tensors through the ring, sliced by vLLM's `load_weights`;
- baseline "naive": the whole state dict gathered on rank 0, shipped through Ray's object store, loaded with
  `load_weights`;
- floor: one single-process memcpy of the engine's weight bytes.
Every method is also verified from scratch: the engine's weights are discarded (level-2 sleep: zeros), the
method syncs alone, and each worker's parameters must then equal the trainer's after the cast.
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
        hf_config = rt.sync.hf_config
        ring = WeightSync(rt.trainers, rt.engines, specs, cfg=cfg.sync, hf_config=hf_config)
        first = WeightSync(rt.trainers, rt.engines, specs, cfg=cfg.sync, hf_config=hf_config, sliced=False)
        ring.open()
        first.open()
        methods = {"colocate": rt.sync, "ring": ring, "baseline_first_version": first}
        # Interleaved (colocate, ring, first version, colocate, ...): drift on a shared machine hits all alike.
        timed = dict(zip(methods, _time_syncs(list(methods.values()), num_syncs, num_warmup, pids)))
        rt.sync.run()  # the breakdown comes from colocate's own last sync
        timed["colocate"]["breakdown"] = _breakdown(rt, rt.sync)
        ring.run()
        timed["ring"]["breakdown"] = _breakdown(rt, ring)
        timed["baseline_naive"] = _time_naive(rt, num_syncs, num_warmup, cfg.engine.dtype)
        naive_sync = _NaiveSync(rt, cfg.engine.dtype)
        for key, sync in (*methods.items(), ("baseline_naive", naive_sync)):
            timed[key]["verified_equal"] = _verified_from_scratch(rt, sync, cfg.engine.dtype)
        plan = rt.sync.plan
        ring_bytes = {key: _ring_bytes(sync.plan, cfg) for key, sync in methods.items()}

    colocate = timed["colocate"]
    result = {
        "config": {"model": cfg.model.preset or cfg.model.path, "engine_dtype": cfg.engine.dtype,
                   "engine_tp": cfg.engine.tp, "num_slots": cfg.placement.num_slots,
                   "transport": "in_place" if plan.in_place else "ring", "plan_mode": plan.mode,
                   "num_buckets": len(plan.buckets), "ring_bucket_slot_bytes": ring.plan.slot_bytes,
                   "ring_num_bucket_slots": ring.plan.num_slots, "verify": cfg.sync.verify,
                   "enforce_eager": cfg.engine.enforce_eager},
        "engine_weight_bytes": engine_bytes,
        "floor_memcpy_s": floor_s,
        **timed,
        "ratios": {
            **{f"{key.removeprefix('baseline_')}_over_floor": timed[key]["median_s"] / floor_s for key in timed},
            "speedup_vs_naive": timed["baseline_naive"]["median_s"] / colocate["median_s"],
            "speedup_vs_first_version": timed["baseline_first_version"]["median_s"] / colocate["median_s"],
            "speedup_vs_ring": timed["ring"]["median_s"] / colocate["median_s"],
            **{f"{key.removeprefix('baseline_')}_extra_bytes_over_model_bytes": n / engine_bytes
               for key, n in ring_bytes.items()},
        },
        "extra_bytes": ring_bytes,  # rings (bucket slots) allocated for the sync, all workers of all engines
    }
    path = write_result(result, out_dir, name)
    _plot(colocate["breakdown"], timed["ring"]["breakdown"], Path(out_dir) / f"{name}.png")
    _print(result, path)
    return result


def _time_syncs(syncs: list[WeightSync], num_syncs: int, num_warmup: int, pids: list[int]) -> list[dict]:
    """Time each sync method `num_syncs` times, interleaved, after `num_warmup` untimed runs of each; then, per
    method alone, how far each process's RSS peaks above its steady state during two more syncs."""
    for _ in range(num_warmup):
        for sync in syncs:
            sync.run()
    stats: list[list[dict]] = [[] for _ in syncs]
    for _ in range(num_syncs):
        for sync, collected in zip(syncs, stats):
            collected.append(sync.run())
    results = []
    for sync, collected in zip(syncs, stats):
        phases = {k: sum(s[k] for s in collected) / len(collected)
                  for k in ("sync_load_s", "sync_verify_s", "sync_post_s")}
        results.append({**summary([s["sync_s"] for s in collected]), "phases_mean_s": phases,
                        "peak_rss_over_steady_bytes": _peak_over_steady(sync, pids)})
    return results


def _peak_over_steady(sync: WeightSync, pids: list[int]) -> dict[str, int]:
    """Per process, the most its RSS rose above its steady state during two syncs. A shared page counts in every
    process that touched it (a ring's pages in the writers and the reader), so the sum over-counts."""
    sync.run()  # steady: whatever this method allocates once (its rings' pages) is resident now
    _reset_peak_rss(pids)
    before = {pid: _status_kib(pid, "VmRSS") for pid in pids}
    for _ in range(2):
        sync.run()
    return {str(pid): (_status_kib(pid, "VmHWM") - before[pid]) * 1024 for pid in pids}


class _NaiveSync:
    """The naive path: the whole state dict gathered on rank 0, through Ray's object store, `load_weights`."""

    def __init__(self, rt: Runtime, dtype: str):
        self.rt, self.dtype = rt, dtype

    def run(self) -> None:
        states = [t.full_state_dict.remote(self.dtype, rank0_only=True) for t in self.rt.trainers]
        ray.get([e.load_state.remote(states[0]) for e in self.rt.engines] + states[1:])


def _time_naive(rt: Runtime, num_syncs: int, num_warmup: int, dtype: str) -> dict:
    naive = _NaiveSync(rt, dtype)
    times = []
    for i in range(num_warmup + num_syncs):
        started = time.perf_counter()
        naive.run()
        if i >= num_warmup:
            times.append(time.perf_counter() - started)
    return summary(times)


def _verified_from_scratch(rt: Runtime, sync, dtype: str) -> bool:
    """Discard the engines' weights (level-2 sleep leaves zeros), sync with this method alone, compare every
    worker's parameters with the trainer's: a method that wrote nothing cannot pass on its predecessor's work."""
    ray.get([e.sleep.remote(2) for e in rt.engines])
    ray.get([e.wake.remote(["weights"]) for e in rt.engines])
    sync.run()
    ray.get([e.wake.remote(["kv_cache"]) for e in rt.engines])
    return rt.sync.verify_full(dtype) == []


def _ring_bytes(plan, cfg: JobConfig) -> int:
    """Bytes of ring allocated for a sync, over all workers of all engines (the CPU full-tensor plan shares one
    ring per engine; in place there is none)."""
    return plan.ring_bytes * cfg.num_engines * (cfg.engine.tp if plan.mode == "sliced" else 1)


def _breakdown(rt: Runtime, sync: WeightSync) -> dict:
    """Per bucket: the trainers' write (cast + pack, slowest rank) and the workers' verify and load, from the last
    sync (in place, the workers' check is one call after all buckets: it is reported as the last bucket's)."""
    buckets = sync.plan.buckets
    writes: dict[int, float] = {}
    for rank_times in ray.get([t.take_write_times.remote() for t in rt.trainers]):
        last = rank_times[-len(buckets) * len(rt.engines):]
        for index, seconds in last:
            writes[index] = max(writes.get(index, 0.0), seconds)
    checks = list(sync.last_buckets)
    checks = [{"verify_s": 0.0, "load_s": 0.0}] * (len(buckets) - len(checks)) + checks
    return {"group": [b.group for b in buckets],
            "write_s": [writes.get(i, 0.0) for i in range(len(buckets))],
            "verify_s": [c["verify_s"] for c in checks],
            "load_s": [c["load_s"] for c in checks],
            "transfer_s": [0.0] * len(buckets),  # shared memory: the write is the transfer
            "bytes": [b.num_bytes for b in buckets]}


def _reset_peak_rss(pids: list[int]) -> None:
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _plot(colocate: dict, ring: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    titles = ("colocate (in place: ranks cast straight into the engine's parameters; the engine checks the layout "
              "once at the end)", "ring (the CUDA path, on the CPU: write of bucket i+1 overlaps verify + load of "
              "bucket i)")
    for ax, breakdown, title in zip(axes, (colocate, ring), titles):
        x = range(len(breakdown["group"]))
        bottom = [0.0] * len(breakdown["group"])
        for key, color in (("write_s", "tab:blue"), ("verify_s", "tab:orange"), ("load_s", "tab:green")):
            values = [v * 1e3 for v in breakdown[key]]
            ax.bar(x, values, bottom=bottom, color=color, label=key.removesuffix("_s"))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(list(x), breakdown["group"], rotation=90, fontsize=7)
        ax.set_ylabel("ms per layer")
        ax.set_title(title, fontsize=9)
        ax.legend(loc="upper right", fontsize=8)
    fig.suptitle("weight sync per layer and phase (slowest rank / worker)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print(result: dict, path: Path) -> None:
    r = result["ratios"]
    mb = result["engine_weight_bytes"] / 1e6
    print(f"engine weights {mb:.0f} MB | floor (memcpy) {result['floor_memcpy_s'] * 1e3:.1f} ms")
    for key, label in (("colocate", f"colocate ({result['config']['transport']})"), ("ring", "ring"),
                       ("baseline_first_version", "first version"), ("baseline_naive", "naive")):
        m = result[key]
        extra = result["extra_bytes"].get(key)
        print(f"{label:>20}: median {m['median_s'] * 1e3:8.1f} ms (min {m['min_s'] * 1e3:.1f}, max "
              f"{m['max_s'] * 1e3:.1f}) | {m['median_s'] / result['floor_memcpy_s']:5.2f}x floor | verified "
              f"{m['verified_equal']}" + (f" | rings {extra / 1e6:.0f} MB" if extra is not None else ""))
    print(f"colocate: {r['speedup_vs_naive']:.1f}x faster than naive, {r['speedup_vs_first_version']:.2f}x than the "
          f"first version, {r['speedup_vs_ring']:.2f}x than the ring")
    print(f"results: {path} (+ .png)")
