"""`colocate bench sync trainer.lora.rank=R`: a LoRA job's adapter-only sync against a sync of the whole model, on
the same trainers and engine, in one run.

    colocate bench sync trainer.lora.rank=8          # bench preset (24 layers, TP=2) with rank-8 adapters

- adapter: what a LoRA job's sync sends (runtime.sync_specs: the adapter alone, the engine keeps its base);
- full model: the same transport sending every tensor, base and adapter, as a full fine-tune's job (or a LoRA job
  at engine.sleep_level=2) does each step;
- floors: a memcpy and the trainers' cast of the adapter's bytes.

In place (the CPU) the two are timed one after the other: an engine has one weight arena at a time. Both are
verified from scratch, in order: the engines' weights are discarded (level-2 sleep: zeros), the full
sync alone must restore every tensor; then the engines' adapter is reinstalled as zeros (a check that would find
it so is part of the result), and the adapter sync alone must make every tensor equal again.
"""

from __future__ import annotations

import ray

from colocate.bench.common import memcpy_floor_s, summary, write_result
from colocate.config import JobConfig
from colocate.job.runtime import Runtime
from colocate.sync.tp_layout import is_adapter
from colocate.sync.weight_sync import WeightSync


def run_lora_sync_bench(rt: Runtime, cfg: JobConfig, *, num_syncs: int, num_warmup: int, out_dir: str,
                        name: str) -> dict:
    assert cfg.trainer.lora.rank, "a LoRA job's bench"
    specs = ray.get(rt.trainers[0].param_specs.remote(cfg.engine.dtype))  # every tensor, base and adapter

    # built here, whatever the job's switch made of rt.sync (at sleep level 2 it sends the base too). In place,
    # an engine has one weight arena at a time and each open shares a new one (engine/extension.py): the two are
    # timed one after the other, each right after its own open, not interleaved
    adapter_specs = [s for s in specs if is_adapter(s.name)]
    syncs, stats = {}, {}
    for key, chosen in (("adapter", adapter_specs), ("full_model", specs)):
        sync = syncs[key] = WeightSync(rt.trainers, rt.engines, chosen, cfg=cfg.sync, hf_config=rt.sync.hf_config,
                                       pairs=rt.pairs, method=rt.sync.method)
        sync.open()
        runs = [sync.run() for _ in range(num_warmup + num_syncs)]
        stats[key] = runs[num_warmup:]
    timed = {key: {**summary([s["sync_s"] for s in runs]), "sync_bytes": runs[-1]["sync_bytes"],
                   "round_trips": runs[-1]["sync_round_trips"], "plan_mode": runs[-1]["sync_mode"]}
             for key, runs in stats.items()}
    adapter_bytes = timed["adapter"]["sync_bytes"]
    floor_s = memcpy_floor_s(adapter_bytes, device=rt.device)
    cast_floor_s = max(ray.get([t.cast_floor_s.remote(adapter_bytes // len(rt.trainers), cfg.engine.dtype)
                                for t in rt.trainers]))
    timed.update(_verified(rt, syncs["full_model"], syncs["adapter"], cfg.engine.dtype))
    result = {
        "config": {"model": cfg.model.preset or cfg.model.path, "engine_dtype": cfg.engine.dtype,
                   "engine_tp": cfg.engine.tp, "num_slots": cfg.placement.num_slots, "device": rt.device,
                   "sync_method": rt.sync.method, "lora_rank": cfg.trainer.lora.rank,
                   "lora_alpha": cfg.trainer.lora.alpha, "lora_target_modules": cfg.trainer.lora.target_modules,
                   "engine_max_lora_rank": cfg.engine.max_lora_rank, "enforce_eager": cfg.engine.enforce_eager},
        "num_params": rt.trainer_info[0]["num_params"],
        "num_trained_params": rt.trainer_info[0]["num_trained_params"],
        **timed,
        "floor_memcpy_adapter_s": floor_s,
        "floor_cast_adapter_s": cast_floor_s,
        "ratios": {
            "adapter_bytes_over_full_bytes": adapter_bytes / timed["full_model"]["sync_bytes"],
            "adapter_time_over_full_time": timed["adapter"]["median_s"] / timed["full_model"]["median_s"],
            "adapter_over_memcpy_floor": timed["adapter"]["median_s"] / floor_s,
            "adapter_over_cast_floor": timed["adapter"]["median_s"] / cast_floor_s,
        },
    }
    path = write_result(result, out_dir, name)
    _print(result, path)
    return result


def _verified(rt: Runtime, full: WeightSync, adapter: WeightSync, dtype: str) -> dict:
    """`full` was opened last, so the engines' arena is its own; the adapter's is opened again after it."""
    ray.get([e.sleep.remote(2) for e in rt.engines])
    ray.get([e.wake.remote(["weights"]) for e in rt.engines])
    full.run()
    ray.get([e.wake.remote(["kv_cache"]) for e in rt.engines])
    full_ok = rt.sync.verify_full(dtype) == []
    adapter.open()  # a new arena, replacing the full sync's
    shapes = ray.get(rt.trainers[0].adapter_shapes.remote())
    ray.get([e.__ray_call__.remote(_reinstall_adapter, shapes) for e in rt.engines])
    zeroed_found = rt.sync.verify_full(dtype) != []  # the check sees an adapter the sync has not written yet
    adapter.run()
    adapter_ok = rt.sync.verify_full(dtype) == []
    return {"verified": {"full_model_from_discarded_weights": full_ok, "adapter_zeros_found_before": zeroed_found,
                         "adapter_from_zeroed_adapter": adapter_ok}}


def _reinstall_adapter(engine, shapes: dict) -> None:
    """On the engine actor: the policy's adapter reinstalled, all zeros, into the same buffers (engine/lora.py)."""
    engine.llm.collective_rpc("colocate_install_adapter", args=(shapes,))


def _print(result: dict, path) -> None:
    a, f, r = result["adapter"], result["full_model"], result["ratios"]
    print(f"LoRA rank {result['config']['lora_rank']} on {result['config']['model']} "
          f"({result['config']['sync_method']}, TP={result['config']['engine_tp']})")
    for key, m in (("adapter", a), ("full model", f)):
        print(f"{key:>12}: {m['sync_bytes'] / 1e6:9.2f} MB, median {m['median_s'] * 1e3:8.1f} ms "
              f"(min {m['min_s'] * 1e3:.1f}, max {m['max_s'] * 1e3:.1f}), {m['round_trips']} round trip(s)")
    print(f"adapter / full: {r['adapter_bytes_over_full_bytes'] * 100:.2f}% of the bytes, "
          f"{r['adapter_time_over_full_time'] * 100:.1f}% of the time; adapter {r['adapter_over_memcpy_floor']:.1f}x "
          f"its memcpy floor, {r['adapter_over_cast_floor']:.1f}x its cast floor | verified {result['verified']}")
    print(f"results: {path}")
