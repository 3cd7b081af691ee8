"""Gather, then hand over locally: the weight-sync protocol of GPU nodes (it runs on the CPU too).

Ray gives each trainer actor only its own GPU, and a CUDA IPC handle opened on another GPU needs that GPU
visible, a context on it and peer access. So on CUDA no rank writes into another GPU's memory: per layer
group, the ranks all-gather their FSDP2 shards over their process group (NCCL over NVLink; gloo on the CPU), and
each rank then casts the TP slice of the one engine worker that shares its device into that worker's ring. IPC
only ever joins two processes on the same device.

    groups = plan_gather(plan, specs, world_size=8)              # pure: where every rank's rows sit
    writer = GatherWriter(plan, groups, rank=r, world_size=8, device=dev, ring=ring_of_my_worker, worker=tp)
    checksums = writer.write(index, local_shards(params))        # every rank, every bucket, the same order

Per bucket: the first bucket of a layer group all-gathers the group (a collective: every rank calls `write`
for every bucket in the same order, also a rank whose device holds no engine worker, with `ring=None`); then the
rank copies its worker's regions of the bucket out of the gathered rows into the worker's ring slot. The engine
worker loads the slot (sync/load.py) while the ranks gather the next group. Only the group's tensors are
gathered, in the engine dtype (each rank casts its own rows first: half the bytes of an fp32 gather).

Layout of the gathered buffer: each rank's chunk holds, for every tensor of the group, `rows_per_rank` rows at
the same offset (FSDP2 shards dim 0 in `torch.chunk` pieces of ceil(rows / world) rows, so rank r holds rows
[r * rows_per_rank, ...), possibly fewer or none); every rank can therefore find any rank's rows without
exchanging sizes. `all_gather_into_tensor` wants equal inputs: a rank with fewer rows leaves padding.

Hazards:
- The gathered buffer is reused by the next group. On CUDA the copies into the ring are enqueued on the current
  stream before the next collective, and ProcessGroupNCCL makes its stream wait for the current stream before a
  collective starts (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, `syncStream`), so the next gather cannot
  overwrite rows still being copied. `run_copies` synchronises before it reports the slot written, because the
  engine worker reads the ring from another process.
- Between syncs the gathered buffers' storages are released (resized to 0) and restored at the next sync: the
  cached views stay valid (same storage objects), and the rollout does not pay for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colocate.sync.buckets import ALIGN, TensorSpec, aligned
from colocate.sync.reshard import SyncPlan, as_2d, rows_per_index
from colocate.sync.shards import Copy, full_copies, run_copies, sliced_copies
from colocate.sync.verify import tensor_spans


@dataclass(frozen=True)
class GatheredTensor:
    name: str
    offset: int  # byte offset inside every rank's chunk
    rows_per_rank: int  # FSDP2's dim-0 chunk, ceil(shape[0] / world_size), in rows of the 2-D view
    num_rows: int
    num_cols: int

    def rank_rows(self, rank: int) -> tuple[int, int]:
        """(first row, number of rows) rank `rank` holds."""
        first = rank * self.rows_per_rank
        return first, max(0, min(self.rows_per_rank, self.num_rows - first))


@dataclass(frozen=True)
class GatherGroup:
    group: str
    tensors: tuple[GatheredTensor, ...]
    rank_bytes: int  # every rank's chunk: the all-gather's input size
    dtype: torch.dtype


def group_tensor_names(plan: SyncPlan) -> dict[str, list[str]]:
    """Per layer group (in bucket order), the trainer tensors its buckets read. Not simply the group's own
    tensors: a tied lm_head (group "post") reads the embeddings (group "pre")."""
    names: dict[str, dict[str, None]] = {}
    for bucket in plan.buckets:
        wanted = names.setdefault(bucket.group, {})
        if plan.mode == "full":
            wanted.update((t.spec.name, None) for t in bucket.tensors)
            continue
        for worker, regions in enumerate(bucket.regions):
            for region in regions:
                wanted.update((p.hf_name, None) for p in plan.pieces[worker].get(region.engine_name, ()))
    return {group: list(wanted) for group, wanted in names.items()}


def plan_gather(plan: SyncPlan, specs: list[TensorSpec], *, world_size: int) -> dict[str, GatherGroup]:
    """Where each rank's rows of each gathered tensor sit, per layer group. Pure."""
    shapes = {s.name: s.shape for s in specs}
    dtype = specs[0].dtype
    groups = {}
    for group, names in group_tensor_names(plan).items():
        tensors, offset = [], 0
        for name in names:
            num_rows, num_cols = as_2d(shapes[name])
            # FSDP2's chunk of dim 0, in rows of the 2-D view (a fused expert tensor: whole experts)
            rows_per_rank = -(-shapes[name][0] // world_size) * rows_per_index(shapes[name])
            tensors.append(GatheredTensor(name, offset, rows_per_rank, num_rows, num_cols))
            offset = aligned(offset + rows_per_rank * num_cols * dtype.itemsize)
        groups[group] = GatherGroup(group, tuple(tensors), max(offset, ALIGN), dtype)
    return groups


class Gatherer:
    """A rank's gather buffers (sized for the largest group, reused by every group) and the collective."""

    def __init__(self, groups: dict[str, GatherGroup], *, rank: int, world_size: int, device: torch.device):
        self.groups, self.rank, self.world_size = groups, rank, world_size
        largest = max(g.rank_bytes for g in groups.values())
        self.send = torch.empty(largest, dtype=torch.uint8, device=device)
        self.received = torch.empty(world_size * largest, dtype=torch.uint8, device=device)
        self._sizes = [(t.untyped_storage(), t.untyped_storage().nbytes()) for t in (self.send, self.received)]
        self.release()  # held only while a sync runs

    def rank_shards(self, group: str) -> list[dict[str, tuple[torch.Tensor, int]]]:
        """Per rank, name -> (that rank's rows as a 2-D view of the gathered buffer, first row): the shape of
        `shards.local_shards`, so the same copy builders serve one rank's rows or all of them."""
        g = self.groups[group]
        out = []
        for rank in range(self.world_size):
            base = rank * g.rank_bytes
            views = {}
            for t in g.tensors:
                first, num_rows = t.rank_rows(rank)
                start = base + t.offset
                flat = self.received[start:start + num_rows * t.num_cols * g.dtype.itemsize]
                views[t.name] = (flat.view(g.dtype).view(num_rows, t.num_cols), first)
            out.append(views)
        return out

    def gather(self, group: str, shards: dict[str, tuple[torch.Tensor, int]]) -> None:
        """Cast this rank's rows of the group's tensors into its chunk, then all-gather every rank's chunk (a
        collective). `shards`: this rank's `local_shards`."""
        import torch.distributed as dist

        g = self.groups[group]
        with torch.no_grad():
            for t in g.tensors:
                local, first = shards[t.name]
                assert (first, local.shape[0]) == t.rank_rows(self.rank) or local.shape[0] == 0, \
                    f"{t.name}: FSDP2 rows [{first}, +{local.shape[0]}) differ from the gather layout"
                if local.shape[0]:
                    size = local.numel() * g.dtype.itemsize
                    self.send[t.offset:t.offset + size].view(g.dtype).view(local.shape).copy_(local)
        dist.all_gather_into_tensor(self.received[:self.world_size * g.rank_bytes], self.send[:g.rank_bytes])

    def release(self) -> None:
        """Give the buffers' memory back between syncs (views into them stay valid): to the driver on CUDA,
        where vLLM's KV-cache wake allocates from the driver, not from torch's cache."""
        for storage, _ in self._sizes:
            storage.resize_(0)
        if self.send.is_cuda:
            torch.cuda.empty_cache()

    def restore(self) -> None:
        for storage, num_bytes in self._sizes:
            if storage.nbytes() != num_bytes:
                storage.resize_(num_bytes)


class GatherWriter:
    """One trainer rank's side of the gather protocol for one sync: gather each group, copy the part of each
    bucket that each of its `targets` (worker, ring) takes into that ring: the engine worker on this rank's
    device (gather), the staging rings of the TP ranks it broadcasts to (sync/broadcast.py), or none."""

    def __init__(self, plan: SyncPlan, groups: dict[str, GatherGroup], *, rank: int, world_size: int,
                 device: torch.device, targets: list[tuple[int, torch.Tensor]], checksum: bool = True):
        assert not plan.in_place
        self.plan, self.targets, self.checksum = plan, targets, checksum
        self.gatherer = Gatherer(groups, rank=rank, world_size=world_size, device=device)
        # (bucket index, worker) -> (copies, tensor spans to checksum); pure views, replayed every sync
        self._copies: dict[tuple[int, int], tuple[list[Copy], list[tuple[int, int]]]] = {}
        self._gathered: str | None = None

    def write(self, index: int, shards: dict[str, tuple[torch.Tensor, int]], *,
              copy: bool = True) -> list[tuple[int, int, int, int]]:
        """Bucket `index`: gather its group if it starts one, then write each target's slice. Returns one
        (worker, start, num_bytes, checksum) per tensor of the bucket and target (one transfer per bucket).
        `copy=False`: take part in the gather only (the slot is not free: the engine's load of it failed)."""
        bucket = self.plan.buckets[index]
        if index == 0:  # a new sync: nothing gathered before counts (an aborted sync may have left its group)
            self.gatherer.restore()
            self._gathered = None
        if bucket.group != self._gathered:
            self.gatherer.gather(bucket.group, shards)
            self._gathered = bucket.group
        written = []
        for worker, ring in self.targets if copy else ():
            if (index, worker) not in self._copies:
                spans = [(s.start, s.num_bytes) for s in tensor_spans(self.plan, index, worker)]
                self._copies[index, worker] = (self._bucket_copies(index, worker, ring), spans)
            copies, spans = self._copies[index, worker]
            # per tensor, not one range per bucket: a mismatch then names its tensor (this rank wrote every row)
            written += run_copies(copies, checksum=self.checksum, spans=spans)
        if index == len(self.plan.buckets) - 1:
            self.gatherer.release()
            self._gathered = None
        return written

    def _bucket_copies(self, index: int, worker: int, ring: torch.Tensor) -> list[Copy]:
        bucket = self.plan.buckets[index]
        copies = []
        for rows in self.gatherer.rank_shards(bucket.group):
            if self.plan.mode == "full":
                copies += full_copies(bucket, rows, ring, worker)
            else:
                copies += sliced_copies(bucket.regions[worker], self.plan.pieces[worker], rows, ring, worker)
        return copies
