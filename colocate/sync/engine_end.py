"""The engine's end of every weight sync open on it: `WorkerEnd` in each vLLM worker (the worker extension
forwards to it), `EngineEnd` in the engine actor (its calls into the workers, their replies folded into one).

    end = WorkerEnd(device=dev)                                  # in a worker, once
    end.share_weights(params)                                    # in place: parameters into a shared arena
    handle = end.open_ring(key, plan, tp_rank=t, params=params)  # every protocol: this worker's ring for `key`
    end.seal(key)                                                # every party mapped it: the names go
    verify_s, load_s, error = end.load(key, index, checksums, load_weights)   # ring, gather, broadcast
    seconds, error = end.receive(key, index)                     # broadcast: before the load of `index`
    seconds, error = end.verify_in_place(key, checksums)         # in place: once, after the writes

Per protocol, a worker's ring is (WorkerEnd.open_ring):
- ring: a buffer of its own (a segment, or CUDA memory), or on the CPU with a full-tensor plan one segment that
  the engine's workers share (EngineEnd creates it: they read the same full tensors);
- gather: a buffer of its own, which only the trainer rank on its device writes;
- broadcast: private memory, filled by the broadcast of its TP rank's group (sync/broadcast.py), joined here;
- in place: its weight arena (sync/arena.py): the trainers write into the parameters, nothing is loaded.
The trainer ends: sync/trainer_end.py; the Ray graph between both: sync/weight_sync.py.

Several syncs may be open at once on one engine (the benchmark runs its baselines beside the real one): each has
a key, and its own plan and ring.

Hazard: verification failures are returned, not raised: an exception in one worker of a collective RPC leaves
the other workers' replies queued in vLLM's executor, and the engine's next RPC would read them (seen: the next
param_layouts() raised this call's error). EngineEnd raises once every worker has answered.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from colocate.errors import SyncVerificationError
from colocate.sync.arena import WeightArena
from colocate.sync.buffers import ShmBuffer, attach, create_buffer
from colocate.sync.load import verify_then_load
from colocate.sync.reshard import SyncPlan
from colocate.sync.verify import corruption_error, mismatched_ranges


@dataclass
class WorkerRing:
    """One sync's ring in one worker."""
    plan: SyncPlan
    ring: torch.Tensor
    owner: object | None  # the buffer this worker created for it (unlinked at seal), else None
    engine: int | None  # this engine's index in the sync, named by its verification errors
    shared: bool  # the engine's workers share it (full plan on the CPU): checksummed under worker 0
    channel: object | None = None  # broadcast: the BroadcastChannel of this worker's TP rank
    receiver: object | None = None  # sync.delta: the DeltaReceiver over that channel (sync/delta_channel.py)


class WorkerEnd:
    def __init__(self, *, device: torch.device):
        self.device = device
        self.arena: WeightArena | None = None  # in place: the parameters, in shared memory
        self.rings: dict[str, WorkerRing] = {}
        self.tp_rank = 0
        self.params: dict[str, torch.Tensor] = {}

    def arena_linked(self) -> bool:
        """The parameters are in an arena that another party can still map (its name not yet unlinked)."""
        return self.arena is not None and self.arena.linked

    def share_weights(self, params: dict[str, torch.Tensor]) -> None:
        """Move the worker's parameters into a new shared-memory arena the trainers write in place (CPU). Once per
        arena: one whose name is gone (an earlier sync sealed it) cannot be mapped again, so a new one replaces it
        (the parameters move once more)."""
        self.arena = WeightArena(params)

    def open_ring(self, key: str, plan: SyncPlan, *, tp_rank: int, params: dict[str, torch.Tensor],
                  shared_handle=None, engine_index: int | None = None, broadcast: dict | None = None):
        """This worker's ring for sync `key` (the module's list); `params`: the engine's tensors the loads write.
        Returns the handle the trainers map (None for a broadcast: nobody maps it). `broadcast`: {"addresses":
        {TP rank: StoreAddress}, "num_members", "timeout_s"}; joins as member 1 + engine_index, and returns once
        the feeders joined too."""
        owner = channel = receiver = None
        if broadcast is not None:
            from colocate.sync.broadcast import BroadcastChannel

            ring, handle = torch.zeros(plan.ring_bytes, dtype=torch.uint8, device=self.device), None
            if broadcast.get("directory"):  # sync.carrier=directory: the feeder's files (sync/directory_carrier.py)
                from colocate.sync.directory_carrier import DirectoryChannel

                channel = DirectoryChannel(broadcast["directory"], name=f"{key}-tp{tp_rank}", rank=1 + engine_index,
                                           timeout_s=broadcast["timeout_s"])
            else:
                channel = BroadcastChannel.join(broadcast["addresses"][tp_rank], rank=1 + engine_index,
                                                size=broadcast["num_members"], device=self.device,
                                                timeout_s=broadcast["timeout_s"])
            if broadcast.get("delta"):
                from colocate.sync.delta_channel import DeltaReceiver

                receiver = DeltaReceiver(channel, element_size=broadcast["element_size"],
                                         pinned=self.device.type == "cuda")
        elif plan.in_place:
            ring, handle = self.arena.tensor, self.arena.handle
        elif shared_handle is None:
            owner = create_buffer(plan.ring_bytes, device=self.device, tag="ring")
            ring, handle = owner.tensor, owner.handle
        else:
            ring, handle = attach(shared_handle), shared_handle
        self.rings[key] = WorkerRing(plan, ring, owner, engine_index, shared_handle is not None, channel, receiver)
        self.tp_rank, self.params = tp_rank, params
        return handle

    def close(self, key: str) -> None:
        """Drop sync `key`'s ring and channel (a broadcast reopened under a new key for a replaced engine)."""
        self.rings.pop(key, None)

    def seal(self, key: str) -> None:
        """Every party has mapped the ring: drop its name (shared memory), so no crash can leak it."""
        session = self.rings[key]
        if session.owner is not None:
            session.owner.unlink()
        if session.plan.in_place:
            self.arena.unlink()

    def load(self, key: str, index: int, checksums: list[tuple[int, int, int, int]],
             load_weights: Callable) -> tuple[float, float, str | None]:
        """Bucket `index` of sync `key`: verify the trainers' byte ranges written into this worker's ring, then
        copy, only if they all match (a mismatch names the tensor; sync/load.py). `load_weights`: vLLM's, for a
        full-tensor plan. Returns (verify seconds, load seconds, error or None)."""
        s = self.rings[key]
        return verify_then_load(s.plan, index, s.ring, checksums, worker=self.tp_rank, params=self.params,
                                load_weights=load_weights, engine=s.engine, shared=s.shared)

    def receive(self, key: str, index: int) -> tuple[float, float, str | None]:
        """Broadcast: receive bucket `index` into this worker's ring slot. Returns (seconds, of which applying a
        delta's changes: sync.delta, error or None)."""
        from colocate.sync.broadcast import receive

        started = time.perf_counter()
        s = self.rings[key]
        try:
            receive(s.plan, index, s.ring, s.channel, self.tp_rank, s.receiver)
        except RuntimeError as e:  # gloo/NCCL: a member died or the group's timeout passed
            return time.perf_counter() - started, 0.0, f"the broadcast of bucket {index} failed: {e}"
        return time.perf_counter() - started, s.receiver.apply_s if s.receiver is not None else 0.0, None

    def verify_in_place(self, key: str, checksums: list[tuple[int, int, int, int]]) -> tuple[float, str | None]:
        """After an in-place sync: every parameter still lives where the trainers wrote (always checked: it costs
        microseconds), and the written ranges hold what the trainers computed (when they sent checksums).
        Returns (seconds, error or None)."""
        started = time.perf_counter()
        s = self.rings[key]
        if s.ring.data_ptr() != self.arena.tensor.data_ptr():
            error = ("this in-place sync writes into a weight arena that a later sync replaced (the weights moved "
                     "to a new one when it was shared again): open the sync again")
        elif detached := self.arena.detached():
            error = (f"{len(detached)} engine parameter(s) left the shared weight arena (e.g. {detached[0]}): the "
                     "in-place sync no longer reaches them")
        elif bad := mismatched_ranges(s.ring, checksums, self.tp_rank):  # WeightSync sends none in place
            error = corruption_error(s.plan, self.tp_rank, bad, index=None, engine=s.engine)
        else:
            error = None
        return time.perf_counter() - started, error

    def owned(self) -> list:
        """The shared memory this worker created: its arena and its rings' buffers (its RSS counts them)."""
        return [b for b in [self.arena, *(s.owner for s in self.rings.values())] if b is not None]


class EngineEnd:
    """The engine actor's end: `collective_rpc(method, args=...)` (vLLM's) calls every worker and returns their
    replies by TP rank."""

    def __init__(self, collective_rpc: Callable, *, device: str):
        self.rpc, self.device = collective_rpc, device
        self._shared_rings: dict[str, ShmBuffer] = {}  # sync key -> the segment a full plan's workers share (CPU)

    def share_weights(self) -> list[dict]:
        """In place: every worker's parameters into its arena (WorkerEnd.share_weights); per worker: tp_rank,
        handle, offsets."""
        return self.rpc("colocate_share_weights")

    def open_ring(self, key: str, plan: SyncPlan, *, shared: bool, engine_index: int | None,
                  broadcast: dict | None) -> list:
        """Every worker's ring for sync `key` (WorkerEnd.open_ring); their handles by TP rank. `shared` (CPU,
        full-tensor plan written by every rank): one segment for all the workers, created here."""
        handle = None
        if shared:
            assert self.device == "cpu" and plan.mode == "full"
            self._shared_rings[key] = ShmBuffer.create(plan.ring_bytes, tag="ring")
            handle = self._shared_rings[key].handle
        return self.rpc("colocate_open_ring", args=(key, plan, handle, engine_index, broadcast))

    def seal_ring(self, key: str) -> None:
        if key in self._shared_rings:
            self._shared_rings[key].unlink()
        self.rpc("colocate_seal_ring", args=(key,))

    def close_ring(self, key: str) -> None:
        self.rpc("colocate_close_ring", args=(key,))

    def receive_bucket(self, key: str, index: int) -> dict:
        """Every worker's receive of bucket `index`: the slowest worker's seconds, and its applying's (sync.delta)."""
        per_worker = self.rpc("colocate_receive", args=(key, index))
        raise_first_error(per_worker)
        return {"receive_s": max(seconds for seconds, _, _ in per_worker),
                "apply_s": max(applying for _, applying, _ in per_worker)}

    def load_bucket(self, key: str, index: int, per_rank_checksums: tuple) -> dict:
        """Every worker's load of bucket `index`, checked against all the trainer ranks' checksums."""
        checksums = [c for rank in per_rank_checksums for c in rank]
        per_worker = self.rpc("colocate_load", args=(key, index, checksums))
        raise_first_error(per_worker)
        # the workers run in parallel: a bucket costs what its slowest worker took
        return {"verify_s": max(v for v, _, _ in per_worker), "load_s": max(lo for _, lo, _ in per_worker)}

    def verify_in_place(self, key: str, per_rank_checksums: tuple) -> dict:
        checksums = [c for rank in per_rank_checksums for c in rank]
        per_worker = self.rpc("colocate_verify_in_place", args=(key, checksums))
        raise_first_error(per_worker)
        return {"verify_s": max(seconds for seconds, _ in per_worker), "load_s": 0.0}


def raise_first_error(per_worker: list[tuple]) -> None:
    """The first worker's error of a collective call, once every worker answered (the module's hazard)."""
    errors = [reply[-1] for reply in per_worker if reply[-1]]
    if errors:
        raise SyncVerificationError(errors[0])
