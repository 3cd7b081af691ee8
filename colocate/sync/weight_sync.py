"""WeightSync: stream the trainer's FSDP2 shards into every engine, layer by layer, through a ring of buckets.

    sync = WeightSync(trainers, engines, specs, cfg=sync_cfg, hf_config=hf_config, method="gather", pairs=pairs)
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

Gather (CUDA, and on the CPU with `sync.method=gather`; sync/gather.py): a rank sees only its own device, so
every rank takes part in an all-gather of each layer group, and rank r writes only into the ring of the engine
worker on its own device (`pairs[r]`, read back from the actors, placement.pair_devices):

    every rank:    gather_write(i) ── all-gather bucket i's group if it starts one; write my worker's slice of i
                      │                (after load(i - num_slots) of my worker's engine: the slot is free)
    engine e:      load(i)          ── after the writes of the ranks that feed e's workers

In place (CPU, `sync.method=auto|in_place`): the engine workers' parameters live in shared memory
(sync/arena.py) and the plan's regions address them, so there is no ring, no slot to wait for and no load:

    trainer ranks: write_in_place  ── every bucket, in layer order, cast straight into the engine's weights
                      │
    engine:        verify_in_place ── parameters still in the arena (no checksums: writer and engine share pages)

Broadcast (split placement, `placement.engine_slots > 0`; sync/broadcast.py): no worker shares a device with a
trainer rank. The ranks gather as above; the feeder of each TP rank broadcasts that rank's slice of bucket i to
the worker of that TP rank in every engine, which receives it into its own ring slot and then loads it:

    every rank:    broadcast_write(i) ── all-gather bucket i's group if it starts one; the feeders send slot i
                      ║  (a collective: both sides run at once, neither waits for the other in Ray)
    engine e:      receive(i)   ── every worker joins its TP rank's broadcast of bucket i
    engine e:      load(i)      ── after the feeders' writes returned (their checksums are its arguments)

An engine runs its calls in the order they were sent, so receive(i + num_slots) refills slot i only after load(i).

Several syncs can be open on the same trainers and engines (the benchmark times its baselines beside the real
one): each has its own key, plan and rings on every party.

The calls above are the actors' Ray methods; each protocol's two ends are sync/trainer_end.py's (TrainerActor
forwards to it) and sync/engine_end.py's (EngineActor and, in each worker, the worker extension forward to it).
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import ray

from colocate.config import SyncConfig
from colocate.sync.buckets import TensorSpec, aligned
from colocate.sync.reshard import SyncPlan, build_sync_plan, worker_layout
from colocate.sync.tp_layout import TPLayout, is_adapter

MIB = 1 << 20
DEFAULT_BROADCAST_TIMEOUT_S = 300  # a broadcast's bound when fault.sync_timeout_s is 0 (no watchdog bound)
log = logging.getLogger("colocate")


class WeightSync:
    """method: "in_place" (CPU), "ring" (CPU: every rank writes its rows into every worker's ring),
    "gather" (every device; needs `pairs`: per trainer rank, the (engine, tp rank) on its device, or None) or
    "broadcast" (split placement: `loopback` when every party is on this node; `timeout_s` bounds a broadcast)."""

    def __init__(self, trainers: list, engines: list, specs: list[TensorSpec], *, cfg: SyncConfig, hf_config,
                 sliced: bool = True, method: str = "ring", pairs: list[tuple[int, int] | None] | None = None,
                 loopback: bool = True, timeout_s: float = 0):
        assert method in ("in_place", "ring", "gather", "broadcast"), method
        assert method != "gather" or pairs is not None, "the gather protocol needs the trainer/worker pairs"
        self.trainers = trainers
        self.engines = engines
        self.specs = specs
        self.cfg = cfg
        self.hf_config = hf_config
        self.sliced = sliced
        self.method = "ring" if method == "in_place" and not sliced else method
        self.pairs = pairs
        self.loopback = loopback
        self.hosts: list[str] = []  # broadcast: the addresses its members reach the feeders' stores at
        self.timeout_s = timeout_s or DEFAULT_BROADCAST_TIMEOUT_S
        self.key = uuid.uuid4().hex[:8]
        self.plan: SyncPlan | None = None
        self._receives: list[list] = []  # broadcast: the last sync's receive calls, per engine

    def open(self) -> SyncPlan:
        """Build the plan from the engines' real parameter layout (ask the workers) and share the rings. Call it
        again after an engine restarts: the plan and rings are rebuilt, never reused stale."""
        layouts = [self._in_scope(w) for w in ray.get(self.engines[0].param_layouts.remote())]
        self.tp_size = len(layouts)
        offsets = None
        if self.method == "in_place":
            # every engine holds the same model in the same order: one plan fits all their arenas
            shared = [sorted(ray.get(e.share_weights.remote()), key=lambda w: w["tp_rank"]) for e in self.engines]
            offsets = [w["offsets"] for w in shared[0]]
            assert all([w["offsets"] for w in s] == offsets for s in shared), "engines disagree on their layout"
        self.plan = build_sync_plan(
            self.specs, layouts,
            self._layout_of,
            # aligned: a fractional sync.bucket_mb would start every later slot unaligned
            bucket_bytes=aligned(int(self.cfg.bucket_mb * MIB)), num_slots=self.cfg.num_bucket_slots,
            sliced=self.sliced, param_offsets=offsets)
        if self.plan.mode == "full" and self.sliced:
            log.warning("no reshard plan for %s: syncing full tensors through vLLM's load_weights",
                        getattr(self.hf_config, "architectures", None))
        # In place, writer and engine share the very pages: a checksum re-read on the engine would compare the
        # memory with itself. What can go wrong there is a parameter leaving the arena, and verify_in_place
        # checks that on every sync. Through a ring, checksums guard the slot reuse and torn or stale writes.
        checksum = self.checksum = self.cfg.verify != "none" and not self.plan.in_place
        if self.method in ("gather", "broadcast"):
            self._open_gather(checksum) if self.method == "gather" else self._open_broadcast(checksum)
            return self.plan
        for engine_index, engine in enumerate(self.engines):
            # full tensors written by every rank (CPU): one segment per engine, its workers read the same bytes
            shared = self.plan.mode == "full" and self.method == "ring"
            handles = ray.get(engine.open_ring.remote(self.key, self.plan, shared=shared, engine_index=engine_index))
            ray.get([t.attach_ring.remote(self.key, engine_index, handles, self.plan, checksum=checksum)
                     for t in self.trainers])
            ray.get(engine.seal_ring.remote(self.key))
        return self.plan

    def _in_scope(self, worker: dict) -> dict:
        """A worker's layout report cut to what this sync writes. A LoRA job's engine holds the adapter's buffers
        beside the base parameters: an adapter-only sync writes the adapter's (the trainer's specs are all
        adapter tensors), else everything but the buffers of sub-layers the adapter leaves out (zeros)."""
        names = {s.name for s in self.specs}
        adapter_only = all(is_adapter(n) for n in names)
        return {**worker, "params": [p for p in worker["params"]
                                     if (p[0] in names if is_adapter(p[0]) else not adapter_only)]}

    def _layout_of(self, tp_rank: int, tp_size: int) -> TPLayout:
        return TPLayout.from_hf_config(self.hf_config, tp_rank=tp_rank, tp_size=tp_size)

    def _open_gather(self, checksum: bool) -> None:
        from colocate.sync.gather import plan_gather

        groups = plan_gather(self.plan, self.specs, world_size=len(self.trainers))
        handles = ray.get([engine.open_ring.remote(self.key, self.plan, engine_index=e)
                           for e, engine in enumerate(self.engines)])
        ray.get([t.attach_gather.remote(self.key, self.plan, groups, pair,
                                        handles[pair[0]][pair[1]] if pair is not None else None, checksum=checksum)
                 for t, pair in zip(self.trainers, self.pairs)])
        ray.get([engine.seal_ring.remote(self.key) for engine in self.engines])

    def _open_broadcast(self, checksum: bool, inherit: str = "") -> None:
        from colocate.sync.gather import plan_gather

        groups = plan_gather(self.plan, self.specs, world_size=len(self.trainers))
        tp = self.tp_size
        members = 1 + len(self.engines)
        addresses = {}
        directory = self.cfg.carrier_dir if self.cfg.carrier == "directory" else ""
        if directory:  # files in a shared directory: no process group, no store to open
            directory = str(Path(directory).expanduser().resolve())
        else:
            for stores in ray.get([t.open_broadcast_stores.remote(self.key, tp=tp, num_members=members,
                                                                    loopback=self.loopback, timeout_s=self.timeout_s)
                                   for t in self.trainers]):
                addresses.update(stores)
            assert sorted(addresses) == list(range(tp)), addresses
            self.hosts = sorted({a.host for a in addresses.values()})
        delta = self.delta
        element_size = self.specs[0].dtype.itemsize if self.specs else 2  # the engine dtype's: its bits compared
        broadcast = {"addresses": addresses, "num_members": members, "timeout_s": self.timeout_s, "delta": delta,
                     "element_size": element_size, "directory": directory}
        # every member joins at once: each join blocks until its whole group has joined
        ray.get([t.attach_broadcast.remote(self.key, self.plan, groups, num_members=members,
                                           timeout_s=self.timeout_s, checksum=checksum, delta=delta,
                                           element_size=element_size, directory=directory, tp=tp,
                                           inherit=inherit)
                 for t in self.trainers]
                + [engine.open_ring.remote(self.key, self.plan, engine_index=e, broadcast=broadcast)
                   for e, engine in enumerate(self.engines)])

    def run(self) -> dict:
        """One full sync into every engine; returns wall time and the summed per-bucket load time."""
        plan = self.plan
        started = time.perf_counter()
        pending: list = []  # writes no load waits for (ranks feeding no worker): awaited for their errors
        if self.method == "gather":
            loads_by_engine, pending = self._schedule_gather()
        elif self.method == "broadcast":
            loads_by_engine, pending = self._schedule_broadcast()
        elif plan.in_place:
            loads_by_engine = self._schedule_in_place()
        else:
            loads_by_engine = self._schedule_rings()
        per_bucket = [ray.get(loads) for loads in loads_by_engine]
        ray.get(pending)
        if plan.in_place:
            post_s = max(b[0]["post_s"] for b in per_bucket)
        else:
            post_s = max(ray.get([engine.finish_sync.remote() for engine in self.engines]))
        self.last_buckets = per_bucket[0]  # engine 0's verify/load times (per bucket through the ring)
        return {"sync_s": time.perf_counter() - started,
                "sync_load_s": sum(b["load_s"] for e in per_bucket for b in e),
                "sync_verify_s": sum(b["verify_s"] for e in per_bucket for b in e),
                "sync_post_s": post_s, "sync_bytes": plan.num_bytes, "sync_buckets": len(plan.buckets),
                # calls into each engine: one per bucket (or one check in place), and the post-load step;
                # never one per tensor or per expert
                "sync_round_trips": len(per_bucket[0]) + (0 if plan.in_place else 1),
                "sync_mode": plan.mode, "sync_method": self.method,
                **({"sync_delta": self._delta_record()} if self.method == "broadcast" and self.delta else {})}

    @property
    def delta(self) -> bool:
        """sync.delta, decided for this sync (a Runtime started on a config that still says auto decides here)."""
        from colocate.sync.delta_channel import uses_delta

        return uses_delta(self.cfg.delta, method=self.method, adapter_only=all(is_adapter(s.name) for s in self.specs))

    def _delta_record(self) -> dict:
        """sync.delta: the sync's density, bytes sent against the full sync's, encode seconds (the slowest feeder's)
        and apply seconds (the slowest engine's: its workers apply in parallel, bucket after bucket), the stores'
        bytes and version, every feeding rank's together (sync/delta_channel.py)."""
        applying = max((sum(r["apply_s"] for r in ray.get(refs)) for refs in self._receives), default=0.0)
        parts = [p for p in ray.get([t.take_delta_stats.remote(self.key) for t in self.trainers]) if p]
        total = {k: sum(p[k] for p in parts) for k in ("changed", "elements", "sent_bytes", "full_bytes",
                                                        "full_slices", "store_bytes")}
        versions = {p["store_version"] for p in parts}
        assert len(versions) == 1, f"the feeders' stores disagree on the version: {sorted(versions)}"
        return {**total, "density": total["changed"] / max(total["elements"], 1),
                "sent_fraction": total["sent_bytes"] / max(total["full_bytes"], 1),
                "encode_s": max(p["encode_s"] for p in parts), "apply_s": applying, "store_version": versions.pop()}

    def _schedule_in_place(self) -> list[list]:
        """Engine e's check (and its post-load step) overlaps the writes into engine e + 1."""
        loads = []
        for engine_index, engine in enumerate(self.engines):
            writes = [t.write_in_place.remote(self.key, engine_index) for t in self.trainers]
            loads.append([engine.verify_in_place.remote(self.key, *writes)])
        return loads

    def _schedule_rings(self) -> list[list]:
        """Every rank writes its rows of bucket i into every worker's ring slot; the engine loads it."""
        plan, key = self.plan, self.key
        loads_by_engine = []
        for engine_index, engine in enumerate(self.engines):
            loads: list = []
            for index in range(len(plan.buckets)):
                after = [loads[index - plan.num_slots]] if index >= plan.num_slots else []
                writes = [t.write_bucket.remote(key, engine_index, index, *after) for t in self.trainers]
                loads.append(engine.load_bucket.remote(key, index, *writes))
            loads_by_engine.append(loads)
        return loads_by_engine

    def _schedule_gather(self) -> tuple[list[list], list]:
        """The gather protocol's Ray graph for one sync (see the module docstring): the loads per engine, and
        the writes of ranks that feed no worker (no load waits for them)."""
        plan, key = self.plan, self.key
        pending = []
        feeders = [[r for r, pair in enumerate(self.pairs) if pair is not None and pair[0] == e]
                   for e in range(len(self.engines))]
        loads: list[list] = [[] for _ in self.engines]
        for index in range(len(plan.buckets)):
            writes = []
            for trainer, pair in zip(self.trainers, self.pairs):
                # Nested in a list, the load is not a Ray dependency (which would cancel this write if the load
                # failed, and leave the other ranks alone in the next all-gather): the rank waits for it itself
                # and, if it failed, still takes part in the gather.
                after = [loads[pair[0]][index - plan.num_slots]] if pair is not None and index >= plan.num_slots \
                    else []
                writes.append(trainer.gather_write.remote(key, index, after))
            pending += [w for w, pair in zip(writes, self.pairs) if pair is None]
            for e, engine in enumerate(self.engines):
                loads[e].append(engine.load_bucket.remote(key, index, *[writes[r] for r in feeders[e]]))
        return loads, pending

    def _schedule_broadcast(self, write: str = "broadcast_write",
                            load_into: list[int] | None = None) -> tuple[list[list], list]:
        """The broadcast protocol's Ray graph for one sync (see the module docstring): the loads per engine, and
        the calls no load waits for (non-feeding ranks' writes, the receives): awaited for their errors. `write`:
        the trainers' method (replay_bucket: from the weight stores); `load_into`: the engines that load (every
        engine receives, since the broadcast is a collective of them all); default all."""
        from colocate.sync.broadcast import feeder_of

        plan, key = self.plan, self.key
        feeders = sorted({feeder_of(t, len(self.trainers)) for t in range(self.tp_size)})
        loading = range(len(self.engines)) if load_into is None else load_into
        pending = []
        self._receives: list[list] = [[] for _ in self.engines]  # per engine: each bucket's receive, for its times
        loads: list[list] = [[] for _ in loading]
        for index in range(len(plan.buckets)):
            writes = [getattr(trainer, write).remote(key, index) for trainer in self.trainers]
            pending += [w for r, w in enumerate(writes) if r not in feeders]
            for e, engine in enumerate(self.engines):
                self._receives[e].append(engine.receive_bucket.remote(key, index))  # no dependency: meets the writes
                pending.append(self._receives[e][-1])
            for i, e in enumerate(loading):
                loads[i].append(self.engines[e].load_bucket.remote(key, index, *[writes[r] for r in feeders]))
        return loads, pending

    def rejoin(self, replaced: list[int]) -> dict:
        """After engines `replaced` were restarted (fault.engine_restarts, job/engine_restarts.py): every feeder and
        engine joins new groups under a new key (the old ones hold the dead processes), the feeders keeping their
        weight stores; then the stores are broadcast whole and loaded into the replaced engines, with no gather:
        the version every other engine holds, without reading the trainers' shards. The others receive it into
        their own stores (a broadcast is every member's collective), so the next sync is a delta for all.
        Returns {"reload_s", "reload_bytes", "store_version"}."""
        assert self.method == "broadcast" and self.delta, "a replaced engine reloads from sync.delta's weight stores"
        started = time.perf_counter()
        old, self.key = self.key, uuid.uuid4().hex[:8]
        # the old rings go first: on a GPU vLLM has taken what it may of the device, and a second ring would not fit
        ray.get([engine.close_ring.remote(old) for e, engine in enumerate(self.engines) if e not in replaced])
        self._open_broadcast(self.checksum, inherit=old)
        version = ray.get(self.trainers[0].store_version.remote(self.key))
        reloaded = 0
        if version >= 0:  # nothing synced yet: every engine holds model.path's weights, as the replaced one loaded
            loads, pending = self._schedule_broadcast("replay_bucket", load_into=replaced)
            ray.get([ref for refs in loads for ref in refs])
            ray.get(pending)
            ray.get([self.engines[e].finish_sync.remote() for e in replaced])
            reloaded = self.plan.num_bytes
        return {"reload_s": time.perf_counter() - started, "reload_bytes": reloaded, "store_version": version}

    def verify_full(self, engine_dtype: str, engines: list[int] | None = None) -> list[str]:
        """Compare every engine worker's parameters (of `engines`, default all) with the trainer's, cast to the
        engine dtype, through the independent layout oracle (plan.engine_tensor). Returns the mismatched
        "engine/worker/param" names."""
        from colocate.sync.tp_layout import compare_engine_state

        # a collective on every rank; only rank 0 ships the result
        trainer_state = ray.get([t.full_state_dict.remote(engine_dtype, rank0_only=True) for t in self.trainers])[0]
        mismatched = []
        for e, engine in enumerate(self.engines):
            if engines is not None and e not in engines:
                continue
            layouts = ray.get(engine.param_layouts.remote())
            for layout, state in zip(layouts, ray.get(engine.state_dicts.remote())):
                tp = worker_layout(layout, self._layout_of)
                mismatched += [f"engine{e}/tp{layout['tp_rank']}/{n}"
                               for n in compare_engine_state(state, trainer_state, tp)]
        return mismatched
