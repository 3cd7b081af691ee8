"""`colocate bench sync`: weight sync time against the memcpy floor and two baselines, in one run.

    colocate bench sync                                   # bench preset: 24 layers, >= 0.4 GB bf16, TP=2, CPU
    colocate bench sync configs/default.yaml --repeats 10
    colocate bench sync trainer.lora.rank=8               # a LoRA job: adapter-only against full (bench/lora_sync.py)

Measured side by side on the same trainers and engine:
- colocate: the job's own sync (`sync.method=auto`): on the CPU in place, each FSDP2 rank casting its rows of
  each worker's TP slice straight into the worker's parameters (kept in shared memory); on CUDA the gather;
- gather: the GPU protocol (all-gather each layer over the trainers' group, each rank feeds the worker on its
  own device through that worker's ring, the worker copies into its parameters), on the CPU with gloo;
- ring (CPU only): every rank writes its rows of every worker's TP slice into that worker's ring;
- baseline "first version": full HF tensors through the rings, sliced by vLLM's `load_weights`;
- baseline "naive": the whole state dict gathered on rank 0, shipped through Ray's object store, loaded with
  `load_weights`;
- floors, on the device that does the work: one memcpy of the engine's weight bytes (device to device on GPU),
  and the cast floor: the trainer processes themselves casting their share of the weights from fp32 to the
  engine dtype at once (the trainer keeps fp32, the engine bf16: every sync reads 2 bytes per byte written).
Where the job's own sync spends its time above the cast floor (`above_cast_floor` in the JSON, one line of the
summary): per-copy calls, TP slicing's strided reads, the checksum's read, the writes inside a sync over their
replay alone, and Ray's calls. Every method is also verified from scratch: the engine's weights are discarded
(level-2 sleep: zeros), the method syncs alone, and each worker's parameters must then equal the trainer's after
the cast.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import ray

from colocate.bench.common import memcpy_floor_s, summary, write_result
from colocate.config import JobConfig
from colocate.job.preflight import num_routed_experts
from colocate.job.runtime import Runtime
from colocate.sync.weight_sync import WeightSync


def run_sync_bench(cfg: JobConfig, *, num_syncs: int, num_warmup: int, out_dir: str, name: str) -> dict:
    if cfg.placement.split:  # the broadcast, with and without sync.delta, after real steps
        from colocate.bench.sync_broadcast import run_broadcast_bench

        return run_broadcast_bench(cfg, num_steps=num_syncs, out_dir=out_dir, name=name)
    with Runtime(cfg) as rt:
        if cfg.trainer.lora.rank:  # the adapter-only sync against the whole model's (bench/lora_sync.py)
            from colocate.bench.lora_sync import run_lora_sync_bench

            return run_lora_sync_bench(rt, cfg, num_syncs=num_syncs, num_warmup=num_warmup, out_dir=out_dir,
                                       name=name)
        worker_memory = [w for e in ray.get([e.memory.remote() for e in rt.engines]) for w in e]
        engine_bytes = sum(w["weight_bytes"] for w in worker_memory)
        device, rt_method = rt.device, rt.sync.method
        floor_s = memcpy_floor_s(engine_bytes, device=device)
        pids = ray.get([t.pid.remote() for t in rt.trainers]) + [w["pid"] for w in worker_memory]

        specs = ray.get(rt.trainers[0].param_specs.remote(cfg.engine.dtype))
        cast_floor_s = max(ray.get([t.cast_floor_s.remote(engine_bytes // len(rt.trainers), cfg.engine.dtype)
                                    for t in rt.trainers]))
        methods = _methods(rt, cfg, specs)
        # Interleaved (colocate, gather, ring, first version, colocate, ...): drift hits all alike.
        timed = dict(zip(methods, _time_syncs(list(methods.values()), num_syncs, num_warmup, pids)))
        for key in ("colocate", "gather"):
            methods[key].run()  # the breakdown comes from the method's own last sync
            timed[key]["breakdown"] = _breakdown(rt, methods[key])
        timed["baseline_naive"] = _time_naive(rt, num_syncs, num_warmup, cfg.engine.dtype)
        naive_sync = _NaiveSync(rt, cfg.engine.dtype)
        for key, sync in (*methods.items(), ("baseline_naive", naive_sync)):
            timed[key]["verified_equal"] = _verified_from_scratch(rt, sync, cfg.engine.dtype)
        above = _above_cast_floor(rt, cfg, cast_floor_s=cast_floor_s, engine_bytes=engine_bytes, repeats=num_syncs)
        plan, gather_plan = rt.sync.plan, methods["gather"].plan
        num_experts = num_routed_experts(rt.sync.hf_config.to_dict())
        ring_bytes = {key: _ring_bytes(sync, cfg) for key, sync in methods.items()}

    colocate = timed["colocate"]
    result = {
        "config": {"model": cfg.model.preset or cfg.model.path, "engine_dtype": cfg.engine.dtype,
                   "engine_tp": cfg.engine.tp, "num_slots": cfg.placement.num_slots, "device": device,
                   "sync_method": rt_method, "plan_mode": plan.mode,
                   "num_buckets": len(plan.buckets), "ring_bucket_slot_bytes": gather_plan.slot_bytes,
                   "ring_num_bucket_slots": gather_plan.num_slots, "verify": cfg.sync.verify,
                   "enforce_eager": cfg.engine.enforce_eager, "num_experts": num_experts,
                   "expert_parallel": cfg.engine.expert_parallel},
        "engine_weight_bytes": engine_bytes,
        "floor_memcpy_s": floor_s,
        "floor_cast_s": cast_floor_s,
        **timed,
        "above_cast_floor": above,
        "ratios": {
            **{f"{key.removeprefix('baseline_')}_over_floor": timed[key]["median_s"] / floor_s for key in timed},
            **{f"{key.removeprefix('baseline_')}_over_cast_floor": timed[key]["median_s"] / cast_floor_s
               for key in timed},
            "speedup_vs_naive": timed["baseline_naive"]["median_s"] / colocate["median_s"],
            "speedup_vs_first_version": timed["baseline_first_version"]["median_s"] / colocate["median_s"],
            **({"speedup_vs_ring": timed["ring"]["median_s"] / colocate["median_s"]} if "ring" in timed else {}),
            "gather_over_colocate": timed["gather"]["median_s"] / colocate["median_s"],
            **{f"{key.removeprefix('baseline_')}_extra_bytes_over_model_bytes": n / engine_bytes
               for key, n in ring_bytes.items()},
        },
        "extra_bytes": ring_bytes,  # rings (bucket slots) allocated for the sync, all workers of all engines
    }
    path = write_result(result, out_dir, name)
    _plot(colocate["breakdown"], timed["gather"]["breakdown"], rt_method, Path(out_dir) / f"{name}.png")
    _print(result, path)
    return result


def _above_cast_floor(rt: Runtime, cfg: JobConfig, *, cast_floor_s: float, engine_bytes: int, repeats: int) -> dict:
    """Where the job's own sync spends its time above the cast floor, over `repeats` more syncs. Each trainer rank
    then replays its copies of the last one, all ranks at once as in a sync, each copy timed alone
    (sync/shards.py `profile_copies`). The slowest rank's split, at the cast floor's rate per byte:
    - cast: its bytes at the floor's rate (what no layout can beat);
    - per_copy: its copies from contiguous rows, above that rate (many calls instead of one cast);
    - tp_slicing: its copies from column slices (row-parallel weights cut for TP: strided reads), above that rate;
    - checksum: the read of every written range (ring and gather syncs; in place has none);
    - writes_over_replay: its writes inside the syncs, above the replay of the same copies (the other rank's and
      the engine's work beside them, Python between buckets);
    - calls: the sync's wall time above its slowest rank's writes (Ray's calls, the engine's check and load
      where they do not overlap the writes)."""
    if rt.sync.method not in ("in_place", "ring"):
        return {"profiled": False, "reason": f"sync.method={rt.sync.method}: only the CPU's ring and in-place "
                "writes are replayed (the gather's writes are in `breakdown`)"}
    walls, writes = [], []
    for _ in range(repeats):
        ray.get([t.take_write_times.remote() for t in rt.trainers])
        walls.append(rt.sync.run()["sync_s"])
        writes.append(max(sum(s for _, s in times) for times in ray.get([t.take_write_times.remote()
                                                                          for t in rt.trainers])))
    # the replay rewrites what the last sync wrote, which the engine then already holds
    profiles = ray.get([t.profile_sync_write.remote(rt.sync.key, repeats=repeats) for t in rt.trainers])
    slowest = max(profiles, key=lambda p: p["contiguous_s"] + p["strided_s"])
    per_byte = cast_floor_s / (engine_bytes / len(rt.trainers))
    checksummed = cfg.sync.verify != "none" and not rt.sync.plan.in_place
    wall_s, writes_s = statistics.median(walls), statistics.median(writes)
    split = {"cast_s": (slowest["contiguous_bytes"] + slowest["strided_bytes"]) * per_byte,
             "per_copy_s": slowest["contiguous_s"] - slowest["contiguous_bytes"] * per_byte,
             "tp_slicing_s": slowest["strided_s"] - slowest["strided_bytes"] * per_byte,
             "checksum_s": slowest["checksum_s"] if checksummed else 0.0}
    split["writes_over_replay_s"] = writes_s - sum(split.values())
    split["calls_s"] = wall_s - writes_s
    return {"profiled": True, "median_s": wall_s, "runs": repeats, **split, "above_floor_s": wall_s - cast_floor_s,
            "checksummed": checksummed, "slowest_rank": profiles.index(slowest), "ranks": profiles}


def _methods(rt: Runtime, cfg: JobConfig, specs: list) -> dict[str, WeightSync]:
    """The job's own sync, the gather protocol, the CPU's ring, and the first version (full tensors through
    vLLM's load_weights: through the rings on the CPU, through the gather on CUDA). Each opened with its own key
    beside the others."""
    def make(**kwargs) -> WeightSync:
        sync = WeightSync(rt.trainers, rt.engines, specs, cfg=cfg.sync, hf_config=rt.sync.hf_config, pairs=rt.pairs,
                          **kwargs)
        sync.open()
        return sync

    methods = {"colocate": rt.sync}
    methods["gather"] = rt.sync if rt.sync.method == "gather" else make(method="gather")
    if rt.device == "cpu":
        methods["ring"] = make(method="ring")
        methods["baseline_first_version"] = make(method="ring", sliced=False)
    else:
        methods["baseline_first_version"] = make(method="gather", sliced=False)
    return methods


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
                        "round_trips": collected[-1]["sync_round_trips"], "plan_mode": collected[-1]["sync_mode"],
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


def _ring_bytes(sync: WeightSync, cfg: JobConfig) -> int:
    """Bytes of ring allocated for a sync, over all workers of all engines (the CPU's full-tensor ring is one
    per engine, shared by its workers; in place there is none)."""
    shared = sync.plan.mode == "full" and sync.method == "ring"
    return sync.plan.ring_bytes * cfg.num_engines * (1 if shared else cfg.engine.tp)


def _breakdown(rt: Runtime, sync: WeightSync) -> dict:
    """Per bucket: the trainers' write (cast + pack, slowest rank) and the workers' verify and load, from the last
    sync (in place, the workers' check is one call after all buckets: it is reported as the last bucket's)."""
    buckets = sync.plan.buckets
    writes: dict[int, float] = {}
    writes_per_sync = len(buckets) * (1 if sync.method == "gather" else len(rt.engines))
    for rank_times in ray.get([t.take_write_times.remote() for t in rt.trainers]):
        last = rank_times[-writes_per_sync:]
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


def _plot(colocate: dict, gather: dict, method: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    titles = (f"colocate ({method}" + (": ranks cast straight into the engine's parameters; the engine checks "
                                       "the layout once at the end)" if method == "in_place" else ")"),
              "gather (the GPU protocol: all-gather layer i+1 and write it while the workers verify + load layer i)")
    for ax, breakdown, title in zip(axes, (colocate, gather), titles):
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
    print(f"engine weights {mb:.0f} MB | floors on {result['config']['device']}: memcpy "
          f"{result['floor_memcpy_s'] * 1e3:.1f} ms, cast fp32 -> {result['config']['engine_dtype']} in the trainer "
          f"processes {result['floor_cast_s'] * 1e3:.1f} ms")
    for key, label in (("colocate", f"colocate ({result['config']['sync_method']})"), ("gather", "gather"),
                       ("ring", "ring"), ("baseline_first_version", "first version"), ("baseline_naive", "naive")):
        if key not in result:
            continue
        m = result[key]
        extra = result["extra_bytes"].get(key)
        print(f"{label:>20}: median {m['median_s'] * 1e3:8.1f} ms (min {m['min_s'] * 1e3:.1f}, max "
              f"{m['max_s'] * 1e3:.1f}) | {m['median_s'] / result['floor_memcpy_s']:5.2f}x memcpy, "
              f"{m['median_s'] / result['floor_cast_s']:5.2f}x cast | verified "
              f"{m['verified_equal']}" + (f" | {m['round_trips']} round trips ({m['plan_mode']})"
                                          if "round_trips" in m else "")
              + (f" | rings {extra / 1e6:.0f} MB" if extra is not None else ""))
    if result["config"]["num_experts"]:
        print(f"{result['config']['num_experts']} experts per layer"
              + (", expert parallel" if result["config"]["expert_parallel"] else "")
              + ": every method's round trips are per bucket (layer), none per expert")
    above = result["above_cast_floor"]
    own = result["colocate"]["median_s"]
    line = (f"colocate ({result['config']['sync_method']}): {own * 1e3:.1f} ms, {own / result['floor_cast_s']:.2f}x "
            f"the cast floor ({own / result['floor_memcpy_s']:.2f}x memcpy)")
    if above["profiled"]:
        line += "; above the floor: " + ", ".join(
            f"{label} {above[key] * 1e3:.1f} ms" for key, label in (
                ("per_copy_s", "per-copy calls"), ("tp_slicing_s", "TP slicing"), ("checksum_s", "checksum"),
                ("writes_over_replay_s", "writes in the sync over their replay"), ("calls_s", "Ray calls")))
        line += f" (over {above['runs']} more syncs, median {above['median_s'] * 1e3:.1f} ms)"
    print(line)
    print(f"colocate: {r['speedup_vs_naive']:.1f}x faster than naive, {r['speedup_vs_first_version']:.2f}x than the "
          f"first version; gather takes {r['gather_over_colocate']:.2f}x colocate's time")
    print(f"results: {path} (+ .png)")
