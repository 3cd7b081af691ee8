"""TrainerEnd: a trainer rank's end of every weight sync open on it, one endpoint per protocol, by sync key.

TrainerActor holds one and forwards WeightSync's calls to it (the Ray method names are the actor's); `shards`
are the rank's local rows (sync/shards.py `local_shards`), resident: the actor onloads them first.

    end = TrainerEnd(rank=r, world_size=w, device=dev)
    end.attach_ring(key, e, handles, plan, checksum=True)        # ring, in place: map engine e's rings (arenas)
    checksums = end.write_bucket(key, e, index, shards)          # ring: this rank's rows of bucket `index`
    checksums = end.write_in_place(key, e, shards)               # in place: every bucket, in order
    end.attach_gather(key, plan, groups, pair, handle, checksum=True)   # gather: feed the worker on my device
    checksums = end.gather_write(key, index, after, shards)
    addresses = end.open_broadcast_stores(key, tp=2, num_members=3, loopback=True, timeout_s=60)
    end.attach_broadcast(key, plan, groups, num_members=3, timeout_s=60, checksum=True)   # beside the engines
    checksums = end.broadcast_write(key, index, shards)

The endpoints: `RingWriter` (below) for the ring and in place, sync/gather.py `GatherWriter` for the gather,
sync/broadcast.py `BroadcastFeeder` for the broadcast; their engine ends are in sync/engine_end.py, and the Ray
graph that drives both ends in sync/weight_sync.py.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from colocate.host.devices import copy_seconds
from colocate.sync.buffers import attach
from colocate.sync.reshard import SyncPlan
from colocate.sync.shards import Copy, bucket_copies, profile_copies, run_copies

Checksums = list[tuple[int, int, int, int]]  # (worker, start, num_bytes, checksum) per written range


class RingWriter:
    """The trainer end of the ring and in-place protocols for one engine: this rank writes its rows of every
    bucket into every worker's ring slot (in place: straight into the workers' weight arenas)."""

    def __init__(self, plan: SyncPlan, rings: list[torch.Tensor], *, checksum: bool):
        self.plan, self.rings, self.checksum = plan, rings, checksum
        self._copies: dict[int, list[Copy]] = {}  # bucket index -> its copies (pure views), built on first use

    def write(self, index: int, shards: dict) -> Checksums:
        if index not in self._copies:
            self._copies[index] = bucket_copies(self.plan, index, shards, self.rings)
        return run_copies(self._copies[index], checksum=self.checksum)

    def all_copies(self, shards: dict) -> list[Copy]:
        """Every bucket's copies, built afresh (the benchmark's replay)."""
        return [c for index in range(len(self.plan.buckets)) for c in bucket_copies(self.plan, index, shards,
                                                                                      self.rings)]


class TrainerEnd:
    def __init__(self, *, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._rings: dict[tuple[str, int], RingWriter] = {}  # (sync key, engine index): ring and in place
        self._gather_writers: dict = {}  # sync key -> GatherWriter (the gather protocol)
        self._broadcast_stores: dict = {}  # sync key -> {TP rank: (TCPStore, StoreAddress)}, until attached
        self._feeders: dict = {}  # sync key -> BroadcastFeeder (split placement)
        # bounded: a long run never asks for them (only the sync benchmark does)
        self.write_times: deque[tuple[int, float]] = deque(maxlen=4096)

    def _timed(self, index: int, write) -> Checksums:
        started = time.perf_counter()
        written = write()
        self.write_times.append((index, time.perf_counter() - started))
        return written

    # ----------------------------------------------------------------------------------- ring and in place

    def attach_ring(self, key: str, engine_index: int, handles: list, plan: SyncPlan, *, checksum: bool) -> None:
        """Map the rings of one engine's workers for sync `key` (`handles` by TP rank; a shared ring is mapped
        once)."""
        mapped: dict = {}
        rings = []
        for handle in handles:
            key_of = getattr(handle, "name", None) or id(handle)  # a shared segment arrives once per worker
            if key_of not in mapped:
                mapped[key_of] = attach(handle)
            rings.append(mapped[key_of])
        self._rings[key, engine_index] = RingWriter(plan, rings, checksum=checksum)

    def write_bucket(self, key: str, engine_index: int, index: int, shards: dict) -> Checksums:
        """This rank's part of bucket `index` (the caller waited for the load that last used its ring slot)."""
        return self._timed(index, lambda: self._rings[key, engine_index].write(index, shards))

    def write_in_place(self, key: str, engine_index: int, shards: dict) -> Checksums:
        """This rank's part of every bucket, in order, straight into the engine's parameters (no slot to wait
        for). Returns the checksums of all of them."""
        plan = self._rings[key, engine_index].plan
        assert plan.in_place
        return [c for index in range(len(plan.buckets)) for c in self.write_bucket(key, engine_index, index, shards)]

    # ------------------------------------------------------------------------------------------ benchmark

    def cast_floor_s(self, num_bytes: int, dtype: torch.dtype, *, repeats: int = 5) -> float:
        """Median seconds for this process to cast fp32 values into `num_bytes` of `dtype` on its device, the
        least any sync from fp32 shards to a bf16 engine costs it (it reads 2 bytes per byte)."""
        source = torch.ones(num_bytes // dtype.itemsize, dtype=torch.float32, device=self.device)
        return copy_seconds(torch.empty(source.shape, dtype=dtype, device=self.device), source, repeats=repeats)

    def profile(self, key: str, shards: dict, *, repeats: int = 5) -> dict:
        """This rank's copies of every bucket of ring or in-place sync `key`, into every engine, replayed and
        timed by source layout, and their checksum (sync/shards.py `profile_copies`).
        Hazard: the replay writes into the engine what the last sync wrote; call it right after a sync, before the
        parameters change, or the engine holds weights no sync verified."""
        copies = [c for (k, _), ring in self._rings.items() if k == key for c in ring.all_copies(shards)]
        return profile_copies(copies, repeats=repeats)

    # ------------------------------------------------------------------------------------------- gather

    def attach_gather(self, key: str, plan: SyncPlan, groups: dict, pair: tuple[int, int] | None, handle, *,
                      checksum: bool) -> None:
        """The gather protocol for sync `key`: this rank all-gathers every layer group with the other ranks and
        feeds only `pair` (engine, tp rank), the worker on its own device, through that worker's ring
        (`handle`); a rank with no worker beside it (pair None) takes part in the gather only."""
        from colocate.sync.gather import GatherWriter

        self._gather_writers[key] = GatherWriter(
            plan, groups, rank=self.rank, world_size=self.world_size, device=self.device,
            targets=[(pair[1], attach(handle))] if pair is not None else [], checksum=checksum)

    def gather_write(self, key: str, index: int, after: list, shards: dict) -> Checksums:
        """Bucket `index` of a gather sync. `after`: [the paired engine's load of the bucket that last used this
        ring slot] (Ray object refs), waited for here: the slot is free once it returned. If that load failed,
        this rank still takes part in the all-gather (every rank must, or the group falls out of step), writes
        nothing, and raises the load's error."""
        failed = None
        if after:  # none for the first num_slots buckets
            import ray

            try:
                ray.get(after)
            except Exception as e:  # the engine's error, raised again once the collective is done
                failed = e
        written = self._timed(index, lambda: self._gather_writers[key].write(index, shards, copy=failed is None))
        if failed is not None:
            raise failed
        return written

    # ---------------------------------------------------------------------------------------- broadcast

    def open_broadcast_stores(self, key: str, *, tp: int, num_members: int, loopback: bool,
                              timeout_s: float) -> dict:
        """Split placement, first half of opening sync `key`: a store for the group of every TP rank this rank
        feeds (sync/broadcast.py), on a free port. Returns {TP rank: StoreAddress} for the engine workers."""
        from colocate.sync.broadcast import fed_by, node_address, open_store

        host = node_address(loopback)
        stores = {t: open_store(host, f"{key}-tp{t}", size=num_members, timeout_s=timeout_s)
                  for t in fed_by(self.rank, tp=tp, num_trainer_ranks=self.world_size)}
        self._broadcast_stores[key] = stores
        return {t: address for t, (_, address) in stores.items()}

    def attach_broadcast(self, key: str, plan: SyncPlan, groups: dict, *, num_members: int, timeout_s: float,
                         checksum: bool, delta: bool = False, element_size: int = 2, directory: str = "",
                         tp: int = 0, inherit: str = "") -> None:
        """Second half: join the groups (this blocks until their engine workers join too: call it beside the
        engines' open_ring) and stage the fed TP ranks' slices. A rank that feeds none gathers only. `inherit`: the
        key of a sync of the same plan whose weight stores and version this one takes over, and which is closed
        (fault.engine_restarts reopens the groups for a replaced engine)."""
        from colocate.sync.broadcast import BroadcastChannel, BroadcastFeeder

        if directory:  # sync.carrier=directory: files in a shared directory, no process group (no stores opened)
            from colocate.sync.broadcast import fed_by
            from colocate.sync.directory_carrier import DirectoryChannel

            channels = {t: DirectoryChannel(directory, name=f"{key}-tp{t}", rank=0, timeout_s=timeout_s)
                        for t in fed_by(self.rank, tp=tp, num_trainer_ranks=self.world_size)}
        else:
            channels = {t: BroadcastChannel.join(address, rank=0, size=num_members, device=self.device,
                                                 timeout_s=timeout_s, store=store)
                        for t, (store, address) in self._broadcast_stores.pop(key).items()}
        self._feeders[key] = BroadcastFeeder.create(plan, groups, rank=self.rank, world_size=self.world_size,
                                                    device=self.device, channels=channels, checksum=checksum,
                                                    delta=delta, element_size=element_size)
        if inherit:
            self._feeders[key].adopt(self._feeders.pop(inherit))

    def replay_bucket(self, key: str, index: int) -> Checksums:
        """Bucket `index` of sync `key` sent whole from the weight stores (BroadcastFeeder.replay): no gather."""
        return self._feeders[key].replay(index)

    def store_version(self, key: str) -> int:
        """The version the weight stores of sync `key` hold (-1: nothing synced yet, or no store: sync.delta off)."""
        feeder = self._feeders[key]
        versions = {s.store.version for s in (feeder.senders or {}).values()}
        assert len(versions) <= 1, versions
        return versions.pop() if versions else -1

    def take_delta_stats(self, key: str) -> dict | None:
        """sync.delta: the last broadcast sync's figures on this rank (BroadcastFeeder.take_delta_stats)."""
        return self._feeders[key].take_delta_stats()

    def broadcast_write(self, key: str, index: int, shards: dict) -> Checksums:
        """Bucket `index` of a broadcast sync: gather (every rank), then send each fed TP rank its slice; returns
        once the engines' workers received it (their receive runs beside this call, never after it)."""
        return self._timed(index, lambda: self._feeders[key].write(index, shards))

    def take_write_times(self) -> list[tuple[int, float]]:
        """(bucket index, seconds) of every write since the last call (benchmark breakdown)."""
        times = list(self.write_times)
        self.write_times.clear()
        return times
