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
  collective raise after `timeout_s` instead of hanging the job.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from colocate.sync.reshard import SyncPlan
from colocate.sync.verify import tensor_spans


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

    def __init__(self, group, store, rank: int, size: int):
        self.group, self.store, self.rank, self.size = group, store, rank, size

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
        return cls(_process_group(prefixed, rank, size, device, timeout), store, rank, size)

    def broadcast(self, data: torch.Tensor) -> None:
        """Rank 0's `data` into every member's `data` (same size on every member; a collective)."""
        from torch.distributed import BroadcastOptions

        if data.numel() == 0:
            return
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self.group.broadcast([data], options).wait()


def _process_group(store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
    import torch.distributed as dist

    if device.type == "cuda":
        # Thin and untested here (no GPU on CI): torch's own NCCL group, built as torch.distributed builds a new
        # group's (torch/distributed/distributed_c10d.py, `_new_process_group_helper`: ProcessGroupNCCL(store,
        # group_rank, group_size, options)). The communicator is made at the first collective, on the device of
        # its tensors: the caller's ring on its own GPU.
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)



class BroadcastFeeder:
    """A trainer rank's side of one broadcast sync: the gather protocol's writer, whose targets are staging rings
    of this rank's own (one per TP rank it feeds), and the groups it sends them over."""

    def __init__(self, plan: SyncPlan, writer, channels: dict[int, BroadcastChannel],
                 staging: dict[int, torch.Tensor]):
        self.plan, self.writer, self.channels, self.staging = plan, writer, channels, staging

    @classmethod
    def create(cls, plan: SyncPlan, groups: dict, *, rank: int, world_size: int, device: torch.device,
               channels: dict[int, BroadcastChannel], checksum: bool) -> BroadcastFeeder:
        from colocate.sync.gather import GatherWriter

        # Hazard (buffer reuse): a staging slot is refilled num_slots buckets later, by this same rank, after
        # its broadcast of the earlier bucket returned: the bytes have left (gloo copies them out; NCCL's
        # collective is ordered on this rank's stream before the next cast into the slot).
        staging = {t: torch.empty(plan.ring_bytes, dtype=torch.uint8, device=device) for t in channels}
        writer = GatherWriter(plan, groups, rank=rank, world_size=world_size, device=device,
                              targets=sorted(staging.items()), checksum=checksum)
        return cls(plan, writer, channels, staging)

    def write(self, index: int, shards: dict) -> list[tuple[int, int, int, int]]:
        """Bucket `index`: gather (every rank), cast each fed TP rank's slice into its staging slot, broadcast
        it to that TP rank's workers. Returns the checksums of what was sent, for the workers' loads."""
        written = self.writer.write(index, shards)
        for tp_rank, channel in sorted(self.channels.items()):  # every member's order: no two groups cross
            start, end = slot_extent(self.plan, index, tp_rank)
            channel.broadcast(self.staging[tp_rank][start:end])
        return written


def receive(plan: SyncPlan, index: int, ring: torch.Tensor, channel: BroadcastChannel, worker: int) -> None:
    """An engine worker's receive of bucket `index` into its ring slot (the same bytes the feeder staged)."""
    start, end = slot_extent(plan, index, worker)
    channel.broadcast(ring[start:end])
