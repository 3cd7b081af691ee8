"""The split placement's sync: the same buckets as the gather protocol, moved between devices by a broadcast.

With `placement.engine_slots > 0` no engine worker shares a device with a trainer rank, so nothing can be handed
over through IPC or shared memory (the CUDA path cannot; on the CPU it would tie the layout to one node). Per
layer group the trainer ranks all-gather their FSDP2 shards, as in the gather protocol (sync/gather.py), and then
one rank per TP rank, its feeder, casts that TP rank's slice of each bucket into a staging slot of its own and
broadcasts the slot over a process group whose other members are the worker of that TP rank in every engine:

    group of TP rank t:  feeder rank t % num_trainer_ranks  ->  engine 0 worker t, engine 1 worker t, ...

Engines of the same layout need the same bytes, so one broadcast feeds them all (NCCL's ring or tree on GPUs,
gloo's on the CPU), and every worker receives only its own slice: the TP resharding is done before the bytes
leave the trainer. Each worker receives into a slot of its own ring and loads it exactly as a ring slot
(sync/load.py), after checking the feeder's checksums of what it sent.

    address = open_store(host)                           # feeder: a TCPStore on a free port, before the others
    channel = BroadcastChannel.join(address, rank=0, size=1 + num_engines, device=dev, timeout_s=60)
    channel.broadcast(slot_bytes)                         # rank 0 sends; every other member receives in place

Hazards:
- The group is not torch.distributed's default group: the trainers' FSDP2 group and vLLM's TP group stay as
  they are. The ProcessGroup object is used directly (its `broadcast` takes the root's *group* rank, 0), never
  through `torch.distributed.broadcast`, which maps a global rank (vllm/distributed/utils.py,
  `stateless_init_torch_distributed_process_group`, says the same of its groups).
- A broadcast blocks its root until the members post their receive (gloo's pairs wait for the remote buffer).
  So an engine's receive of bucket i must never wait for the feeder's write of bucket i: the receive is its own
  engine call with no Ray dependency, and only the load that follows it waits for the writes' checksums
  (weight_sync.WeightSync._schedule_broadcast).
- The group's timeout is the sync's fault bound: a member that dies or hangs mid-broadcast makes the others'
  collective raise BroadcastError (at once when the transport sees the peer gone, else after `timeout_s`)
  instead of hanging the job; the job's watchdog then names the member that was lost (job/faults.py).
- On NCCL that needs blocking wait. By default torch's NCCL group has a watchdog thread that finds the failed or
  overdue collective and, under TORCH_NCCL_ASYNC_ERROR_HANDLING's default (3, SkipCleanUp), rethrows it in that
  thread, which ends the process: a lost member killed the survivors, while `wait()` itself never raised (it only
  orders the caller's stream after the collective). Read in torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp
  (main, as of torch 2.9-2.13): the constructor reads TORCH_NCCL_BLOCKING_WAIT and starts no watchdog thread
  under it ("the main thread would throw an exception and it is the user's responsibility to handle it");
  WorkNCCL::wait then blocks until the collective completes, fails or passes the group's timeout, aborts the
  communicator (NCCLComm::abort, so no kernel is left spinning on the GPU) and rethrows in the caller as
  DistBackendError, a RuntimeError, as gloo's errors are. The variable is read once, by the constructor, so it is
  set around this group's construction alone (_nccl_group): the trainers' FSDP2 group and vLLM's keep their
  watchdogs and their asynchronous waits.
"""

from __future__ import annotations

import datetime
import os
import threading
from dataclasses import dataclass

import torch

from colocate.sync.reshard import SyncPlan
from colocate.sync.verify import tensor_spans


class BroadcastError(RuntimeError):
    """This member's broadcast failed: another member of the group died, or hung past the group's timeout."""


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int
    name: str  # the sync's key and TP rank: one store serves one group


def feeder_of(tp_rank: int, num_trainer_ranks: int) -> int:
    """The trainer rank that feeds TP rank `tp_rank`: spread over the ranks, every rank has gathered the group."""
    return tp_rank % num_trainer_ranks


def fed_by(rank: int, *, tp: int, num_trainer_ranks: int) -> list[int]:
    """The TP ranks trainer rank `rank` feeds (none for ranks beyond the TP size: they take part in the gather)."""
    return [t for t in range(tp) if feeder_of(t, num_trainer_ranks) == rank]


def slot_extent(plan: SyncPlan, index: int, worker: int) -> tuple[int, int]:
    """(first byte, end) of what bucket `index` writes into worker `worker`'s ring slot: what is broadcast."""
    spans = tensor_spans(plan, index, worker)
    start = plan.buckets[index].slot * plan.slot_bytes
    if not spans:
        return start, start
    return min(s.start for s in spans), max(s.start + s.num_bytes for s in spans)


def node_address(loopback: bool) -> str:
    """The address the group's members reach the feeder at: loopback when every party is on this node."""
    if loopback:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def open_store(host: str, name: str, *, size: int, timeout_s: float):
    """The feeder's TCPStore on a free port (port 0: the kernel picks, no race with another job's store). It
    returns at once; the members connect while they join. Keep the store as long as the group lives."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                     wait_for_workers=False)
    return store, StoreAddress(host, store.port, name)


class BroadcastChannel:
    """One process's membership of a broadcast group (rank 0: the feeder)."""

    def __init__(self, group, store, rank: int, size: int, name: str = ""):
        self.group, self.store, self.rank, self.size, self.name = group, store, rank, size, name
        self.failed: str | None = None  # the first failure: the group is broken from then on

    @classmethod
    def join(cls, address: StoreAddress, *, rank: int, size: int, device: torch.device, timeout_s: float,
             store=None) -> BroadcastChannel:
        """Every member calls this at once (the constructor connects the full mesh and blocks until all have).
        The feeder passes the store it opened; the others connect to it."""
        from torch.distributed import PrefixStore, TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = TCPStore(address.host, address.port, size, is_master=False, timeout=timeout)
        prefixed = PrefixStore(f"colocate-broadcast/{address.name}", store)
        return cls(_process_group(prefixed, rank, size, device, timeout), store, rank, size, address.name)

    def begin_version(self, version: int) -> None:
        """The feeder starts sync `version`: nothing to do for a process group (the directory carrier removes the
        files no engine reads again: sync/directory_carrier.py)."""

    def broadcast(self, data: torch.Tensor) -> None:
        """Rank 0's `data` into every member's `data` (same size on every member; a collective). Raises
        BroadcastError if a member is lost (see the module's hazards), and at once on any call after that."""
        from torch.distributed import BroadcastOptions

        if data.numel() == 0:
            return
        where = f"the broadcast group {self.name} (member {self.rank} of {self.size})"
        if self.failed is not None:
            raise BroadcastError(f"{where} failed earlier: {self.failed}")
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        try:
            self.group.broadcast([data], options).wait()
        except RuntimeError as e:  # gloo: a peer's connection closed, or the timeout; NCCL: the same (blocking wait)
            self.failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BroadcastError(f"{where} lost a member or passed its timeout: {self.failed}") from None


def _process_group(store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
    import torch.distributed as dist

    if device.type == "cuda":
        return _nccl_group(store, rank, size, timeout)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"
_ENVIRON_LOCK = threading.Lock()  # two groups built at once in one process must not restore each other's value


def _nccl_group(store, rank: int, size: int, timeout: datetime.timedelta):
    """torch's own NCCL group, built as torch.distributed builds a new group's (torch/distributed/
    distributed_c10d.py, `_new_process_group_helper`: ProcessGroupNCCL(store, group_rank, group_size, options)),
    with blocking wait (module hazards): a lost member raises in the survivors, within `timeout`. The communicator
    is made at the first collective, on the device of its tensors: the caller's ring on its own GPU.
    Hazard: os.environ is the process's C environment; a C++ thread calling getenv while it is written could
    read it mid-change. The write is two short calls, at the sync's open, before this group has any thread."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with _ENVIRON_LOCK:
        previous = os.environ.get(BLOCKING_WAIT)
        os.environ[BLOCKING_WAIT] = "1"
        try:
            return dist.ProcessGroupNCCL(store, rank, size, options)
        finally:
            if previous is None:
                del os.environ[BLOCKING_WAIT]
            else:
                os.environ[BLOCKING_WAIT] = previous


class BroadcastFeeder:
    """A trainer rank's side of one broadcast sync: the gather protocol's writer, whose targets are staging rings
    of this rank's own (one per TP rank it feeds), and the groups it sends them over."""

    def __init__(self, plan: SyncPlan, writer, channels: dict[int, BroadcastChannel],
                 staging: dict[int, torch.Tensor], senders: dict | None = None):
        self.plan, self.writer, self.channels, self.staging = plan, writer, channels, staging
        self.senders = senders  # sync.delta: each fed TP rank's DeltaSender (sync/delta_channel.py); None: off
        self.version = -1  # the sync being written (its first bucket starts the next)

    @classmethod
    def create(cls, plan: SyncPlan, groups: dict, *, rank: int, world_size: int, device: torch.device,
               channels: dict[int, BroadcastChannel], checksum: bool, delta: bool = False,
               element_size: int = 2) -> BroadcastFeeder:
        """`delta`: send each slice's changes since the last sync (sync/delta_channel.py), `element_size` the
        engine dtype's width its bits are compared in."""
        from colocate.sync.gather import GatherWriter

        # Hazard (buffer reuse): a staging slot is refilled num_slots buckets later, by this same rank, after
        # its broadcast of the earlier bucket returned: the bytes have left (gloo copies them out; NCCL's
        # blocking wait returns once the collective completed on the GPU).
        staging = {t: torch.empty(plan.ring_bytes, dtype=torch.uint8, device=device) for t in channels}
        writer = GatherWriter(plan, groups, rank=rank, world_size=world_size, device=device,
                              targets=sorted(staging.items()), checksum=checksum)
        senders = None
        if delta:
            from colocate.sync.delta_channel import DeltaSender

            senders = {t: DeltaSender(c, element_size=element_size, pinned=device.type == "cuda")
                       for t, c in channels.items()}
        return cls(plan, writer, channels, staging, senders)

    def write(self, index: int, shards: dict) -> list[tuple[int, int, int, int]]:
        """Bucket `index`: gather (every rank), cast each fed TP rank's slice into its staging slot, broadcast
        it to that TP rank's workers. Returns the checksums of what was sent, for the workers' loads."""
        written = self.writer.write(index, shards)
        if index == 0:
            self.version += 1
            for channel in self.channels.values():
                channel.begin_version(self.version)
        for tp_rank, channel in sorted(self.channels.items()):  # every member's order: no two groups cross
            start, end = slot_extent(self.plan, index, tp_rank)
            if self.senders is None:
                channel.broadcast(self.staging[tp_rank][start:end])
            else:
                self.senders[tp_rank].send(index, self.staging[tp_rank][start:end], version=self.version)
        return written

    def adopt(self, old: BroadcastFeeder) -> None:
        """Take over `old`'s weight stores and version (the same plan, new groups: fault.engine_restarts reopens the
        broadcast for a replaced engine), so the next sync is a delta against what every engine holds."""
        assert self.senders is not None and old.senders is not None and set(self.senders) == set(old.senders)
        assert len(self.plan.buckets) == len(old.plan.buckets) and self.plan.ring_bytes == old.plan.ring_bytes
        for t, sender in self.senders.items():
            sender.store = old.senders[t].store
        self.version = old.version

    def replay(self, index: int) -> list[tuple[int, int, int, int]]:
        """Bucket `index` from the weight stores, whole, to every member (a restarted engine loads it; the others
        only receive it, into their stores), with no gather: the trainers' shards are not read. Returns the
        checksums of the staged bytes, which the loads check as after a write."""
        from colocate.sync.buffers import range_checksums

        assert self.senders is not None, "a replay needs the weight stores of sync.delta"
        written = []
        for tp_rank, channel in sorted(self.channels.items()):  # every member's order, as in write
            start, end = slot_extent(self.plan, index, tp_rank)  # an empty slice too: its header is a collective
            slot = self.staging[tp_rank]
            slot[start:end].copy_(self.senders[tp_rank].store.slices[index])
            self.senders[tp_rank].resend(index, slot[start:end])
            spans = tensor_spans(self.plan, index, tp_rank)
            sums = range_checksums([slot[s.start:s.start + s.num_bytes] for s in spans])
            written += [(tp_rank, s.start, s.num_bytes, total) for s, total in zip(spans, sums)]
        return written

    def take_delta_stats(self) -> dict | None:
        """sync.delta: the last sync's figures, every fed TP rank's together (DeltaStats.record); None: off."""
        if self.senders is None:
            return None
        from colocate.sync.delta_channel import DeltaStats

        total = sum((sender.take_stats() for sender in self.senders.values()), DeltaStats())
        return {**total.record(), "store_bytes": sum(s.store.nbytes for s in self.senders.values()),
                "store_version": self.version}


def receive(plan: SyncPlan, index: int, ring: torch.Tensor, channel: BroadcastChannel, worker: int,
            receiver=None) -> None:
    """An engine worker's receive of bucket `index` into its ring slot (the same bytes the feeder staged).
    `receiver`: sync.delta's DeltaReceiver (sync/delta_channel.py), which receives the slice's changes."""
    start, end = slot_extent(plan, index, worker)
    if receiver is None:
        channel.broadcast(ring[start:end])
    else:
        receiver.receive(index, ring[start:end])
