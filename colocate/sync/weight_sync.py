"""WeightSync: stream the trainer's FSDP2 shards into every engine, layer by layer, through a ring of buckets.

    sync = WeightSync(trainers, engines, specs, engine_dtype="bfloat16", cfg=sync_cfg)
    sync.open()                  # once: rings allocated by the engines, mapped by every rank and worker
    timings = sync.run()         # every step, after training

Per bucket i (slot i % num_slots), as a Ray dependency graph the controller builds once per sync:

    trainer ranks: write(i)  ── each writes its own rows of every tensor in bucket i into the slot
                      │
    engine:        load(i)   ── runs when every rank's write(i) returned (their checksums are its arguments)
                      │
    trainer ranks: write(i + num_slots)  ── waits for load(i): the slot is free again

so writing bucket i+1 overlaps loading bucket i, and no controller round trip sits between them. Only bucket
metadata and checksums cross Ray; the bytes go through the shared ring.
"""

from __future__ import annotations

import time

import ray

from colocate.config import SyncConfig
from colocate.sync.buckets import Bucket, TensorSpec, group_by_layer, largest_layer_bytes, plan_buckets

MIB = 1 << 20


def slot_bytes_for(specs: list[TensorSpec], cfg: SyncConfig) -> int:
    """The configured slot size, or (0) the largest layer so each layer is exactly one bucket."""
    if cfg.bucket_mb > 0:
        return int(cfg.bucket_mb * MIB)
    return largest_layer_bytes(specs)


class WeightSync:
    def __init__(self, trainers: list, engines: list, specs: list[TensorSpec], *, cfg: SyncConfig):
        self.trainers = trainers
        self.engines = engines
        self.cfg = cfg
        self.slot_bytes = slot_bytes_for(specs, cfg)
        self.buckets: list[Bucket] = plan_buckets(group_by_layer(specs), slot_bytes=self.slot_bytes,
                                                  num_slots=cfg.num_bucket_slots)
        self.num_bytes = sum(b.num_bytes for b in self.buckets)

    @property
    def ring_bytes(self) -> int:
        return self.slot_bytes * self.cfg.num_bucket_slots

    def open(self) -> None:
        for engine_index, engine in enumerate(self.engines):
            handle = ray.get(engine.open_ring.remote(self.ring_bytes))
            ray.get([t.attach_ring.remote(engine_index, handle) for t in self.trainers])
            ray.get(engine.seal_ring.remote())

    def run(self) -> dict:
        """One full sync into every engine; returns wall time and the summed per-bucket load time."""
        started = time.perf_counter()
        loads_by_engine = []
        for engine_index, engine in enumerate(self.engines):
            loads: list = []
            for bucket in self.buckets:
                after = [loads[bucket.index - self.cfg.num_bucket_slots]] \
                    if bucket.index >= self.cfg.num_bucket_slots else []
                writes = [t.write_bucket.remote(engine_index, bucket, *after) for t in self.trainers]
                loads.append(engine.load_bucket.remote(bucket, *writes))
            loads_by_engine.append(loads)
        load_s = sum(sum(ray.get(loads)) for loads in loads_by_engine)
        ray.get([engine.finish_sync.remote() for engine in self.engines])
        return {"sync_s": time.perf_counter() - started, "sync_load_s": load_s, "sync_bytes": self.num_bytes,
                "sync_buckets": len(self.buckets)}
