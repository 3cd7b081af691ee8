"""`colocate bench sync` on a split placement: the broadcast sync with and without sync.delta, side by side after
real training steps, each sync verified in full.

    colocate bench sync placement.num_slots=2 placement.engine_slots=1 engine.tp=1 trainer.lr=1e-6

Two syncs are opened on the same trainers and engines (WeightSync, each its own broadcast groups and rings): one
sending every byte (sync.delta=false), one sending each slice's changes against its weight stores (true). After
each RL step (Controller.step: rollout, score, train, and the job's own sync) both run, in alternating order, and
the delta sync's result is compared with the trainers' weights tensor by tensor (verify_full); the first step's
delta sync sends everything (its stores are empty) and is the warmup. Per step: each sync's seconds, the bytes the
delta sent against the full bytes, the density, the encode time. Ratios are taken within the run.
"""

from __future__ import annotations

import dataclasses
import statistics

from colocate.bench.common import machine, write_result
from colocate.config import JobConfig
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.sync.weight_sync import WeightSync


def run_broadcast_bench(cfg: JobConfig, *, num_steps: int, out_dir: str, name: str) -> dict:
    assert cfg.placement.split, "the broadcast sync is the split placement's"
    with Runtime(cfg) as rt:
        controller = Controller(cfg, rt)

        def make(delta: str) -> WeightSync:
            sync = WeightSync(rt.trainers, rt.engines, rt.sync.specs, cfg=dataclasses.replace(cfg.sync, delta=delta),
                              hf_config=rt.sync.hf_config, method="broadcast", loopback=rt.sync.loopback,
                              timeout_s=rt.sync.timeout_s)
            sync.open()
            return sync

        syncs = {"full": make("false"), "delta": make("true")}
        steps = []
        for step in range(num_steps + 1):
            record = controller.step(step)
            order = list(syncs) if step % 2 == 0 else list(reversed(syncs))
            timed = {kind: syncs[kind].run() for kind in order}
            mismatched = syncs["delta"].verify_full(cfg.engine.dtype)
            assert not mismatched, f"the delta sync differs from the trainers' weights: {mismatched[:3]}"
            delta = timed["delta"]["sync_delta"]
            steps.append({"step": step, "lr": record["lr"], "reward_mean": record["reward_mean"],
                          "full_sync_s": timed["full"]["sync_s"], "delta_sync_s": timed["delta"]["sync_s"],
                          **delta})
            print(f"step {step}: density {delta['density']:.2%}, sends {delta['sent_fraction']:.2%} of "
                  f"{delta['full_bytes'] / 2**20:.1f} MiB; sync {timed['delta']['sync_s']:.2f} s with the delta, "
                  f"{timed['full']['sync_s']:.2f} s without (encode {delta['encode_s']:.2f} s, apply "
                  f"{delta['apply_s']:.2f} s)", flush=True)
    timed_steps = steps[1:]  # the first delta sync sends everything: the warmup
    result = {"bench": "sync_broadcast", "machine": machine(),
              "config": {"model": cfg.model.preset or cfg.model.path, "lr": cfg.trainer.lr,
                         "engine_dtype": cfg.engine.dtype, "num_steps": num_steps, "tp": cfg.engine.tp,
                         "num_engines": cfg.num_engines, "trainer_ranks": cfg.placement.num_trainer_ranks},
              "steps": steps,
              "sent_fraction_after_first": max(s["sent_fraction"] for s in timed_steps),
              "density_after_first": [s["density"] for s in timed_steps],
              "delta_time_vs_full": statistics.median(s["delta_sync_s"] / s["full_sync_s"] for s in timed_steps)}
    path = write_result(result, out_dir, name)
    print(f"after the first sync the delta sends at most {result['sent_fraction_after_first']:.2%} of the bytes; "
          f"its sync takes {result['delta_time_vs_full']:.2f}x the full sync's time (median); {path}")
    return result
