"""Gather on the trainer side: each rank writes its own FSDP2 shard straight into the shared bucket.

FSDP2 shards every parameter on dim 0, so the full tensor is the concatenation of the ranks' local shards, and
in row-major memory rank r's shard is one contiguous byte range of the full tensor. On one node every rank can
therefore write its rows at their offset in the bucket and the bucket then holds the full tensor: a gather with
no collective and every byte written once (gloo's all-gather moves ~0.6 GB/s here; a memcpy ~9 GB/s).

    checksums = write_bucket(plan, index, local_shards(params), ring)   # every rank, concurrently, disjoint byte ranges

Two layouts (see reshard.SyncPlan): "sliced" writes, for every engine worker, only that worker's TP slice in
its parameters' layout (each byte of the engine's weights written once, no loader on the other side); "full"
writes whole HF tensors for vLLM's `load_weights` to slice.

This direct write needs every rank to map every worker's buffer: one host's shared memory (the CPU's `ring` and
`in_place` methods). Where a rank sees only its own device (CUDA), sync/gather.py all-gathers first and uses
the same copy builders on the gathered rows.
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Shard

from colocate.sync.buckets import Bucket, Region
from colocate.sync.reshard import Piece, SyncPlan, as_2d, rows_per_index
from colocate.sync.buffers import range_checksums


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's part of `param`, its first row in the full tensor). A replicated or plain tensor belongs
    to rank 0 alone, so exactly one rank writes it."""
    if isinstance(param, DTensor):
        assert param.placements == (Shard(0),), f"unexpected FSDP placement {param.placements}"
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), offset[0]
    is_rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    return (param if is_rank0 else param[:0]), 0


def local_shards(params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (this rank's rows as a 2-D view, first row). Views of the live parameters: build once, reuse
    every sync (the optimizer updates them in place); rebuild after the parameters move (CUDA offload)."""
    shards = {}
    for name, param in params.items():
        local, first = local_rows(param)
        num_cols = as_2d(param.shape)[1]  # of the full tensor: a rank may hold zero rows
        shards[name] = (local.reshape(-1, num_cols), first * rows_per_index(param.shape))
    return shards


class Copy(NamedTuple):
    """One contiguous byte range of a ring (or weight arena) and the trainer rows that fill it."""

    worker: int  # the engine worker whose ring this is (the first one, for a ring the workers share)
    ring: torch.Tensor
    start: int
    num_bytes: int
    destination: torch.Tensor  # view of ring[start:start + num_bytes] in the engine's dtype and shape
    source: torch.Tensor  # view of this rank's live shard; the cast to the engine dtype happens in the copy


def bucket_copies(plan: SyncPlan, index: int, shards: dict[str, tuple[torch.Tensor, int]],
                  rings: list[torch.Tensor]) -> list[Copy]:
    """This rank's copies for bucket `index` into the engine workers' rings (`rings[w]`: worker w's; several
    workers may share one ring, which is then written once). Pure views: build once and replay every sync (the
    optimizer updates the shards in place, and an offload keeps their storages, see trainer/offload.py)."""
    bucket = plan.buckets[index]
    if plan.mode == "full":
        copies, seen = [], set()
        for worker, ring in enumerate(rings):
            if ring.data_ptr() not in seen:  # a shared ring (CPU): one copy, tagged with its first worker
                seen.add(ring.data_ptr())
                copies += full_copies(bucket, shards, ring, worker)
        return copies
    return [c for worker, ring in enumerate(rings)
            for c in sliced_copies(bucket.regions[worker], plan.pieces[worker], shards, ring, worker)]


def run_copies(copies: list[Copy], *, checksum: bool = True,
               spans: list[tuple[int, int]] | None = None) -> list[tuple[int, int, int, int]]:
    """Do the copies; returns (worker, start, num_bytes, checksum) of each range written, for the workers to verify
    before they load (none when `checksum` is off). `spans`: the copies are one writer's whole part of one
    worker's slot, checksummed per tensor span (start, num_bytes) instead of per copy: fewer ranges, and each
    still names one tensor when the worker finds it corrupted (sync/verify.py)."""
    with torch.no_grad():
        for copy in copies:
            copy.destination.copy_(copy.source)
    if copies and copies[0].ring.is_cuda:
        torch.cuda.synchronize(copies[0].ring.device)  # the engine workers read these bytes from other processes
    if not checksum or not copies:
        return []
    if spans is not None:
        assert len({(c.worker, c.ring.data_ptr()) for c in copies}) == 1, "spans lie in one worker's ring"
        ranges = [(copies[0].worker, copies[0].ring, start, num_bytes) for start, num_bytes in spans]
    else:
        ranges = [(c.worker, c.ring, c.start, c.num_bytes) for c in copies]
    # one device-to-host transfer for all of them (a checksum read back per range synchronised per range)
    sums = range_checksums([ring[start:start + num_bytes] for _, ring, start, num_bytes in ranges])
    return [(worker, start, num_bytes, total) for (worker, _, start, num_bytes), total in zip(ranges, sums)]


def write_bucket(plan: SyncPlan, index: int, shards: dict[str, tuple[torch.Tensor, int]],
                 rings: list[torch.Tensor], *, checksum: bool = True) -> list[tuple[int, int, int, int]]:
    """Write this rank's part of bucket `index` into the engine workers' rings (see bucket_copies, run_copies)."""
    return run_copies(bucket_copies(plan, index, shards, rings), checksum=checksum)


def write_local_shards(bucket: Bucket, shards: dict[str, tuple[torch.Tensor, int]],
                       ring: torch.Tensor) -> list[tuple[int, int]]:
    """Write this rank's rows of every full tensor in `bucket`; returns the (start, num_bytes) of each range."""
    copies = full_copies(bucket, shards, ring, 0)
    run_copies(copies, checksum=False)
    return [(c.start, c.num_bytes) for c in copies]


def full_copies(bucket: Bucket, shards: dict[str, tuple[torch.Tensor, int]], ring: torch.Tensor,
                 worker: int) -> list[Copy]:
    copies = []
    for packed in bucket.tensors:
        local, first_row = shards[packed.spec.name]
        if local.numel() == 0:  # more ranks than rows: this rank holds nothing of it
            continue
        dtype = packed.spec.dtype
        row_bytes = local.shape[1] * dtype.itemsize
        start = packed.offset + first_row * row_bytes
        num_bytes = local.numel() * dtype.itemsize
        destination = ring[start:start + num_bytes].view(dtype).view(local.shape)
        copies.append(Copy(worker, ring, start, num_bytes, destination, local.detach()))
    return copies


def sliced_copies(regions: tuple[Region, ...], pieces: dict[str, list[Piece]],
                   shards: dict[str, tuple[torch.Tensor, int]], ring: torch.Tensor, worker: int) -> list[Copy]:
    """For one worker's regions of a bucket, the rows this rank owns of every piece that lands there: engine rows
    [lo, hi) of a region <- HF rows of the piece, restricted to this rank's FSDP2 rows."""
    copies = []
    for region in regions:
        for piece in pieces.get(region.engine_name, ()):
            lo = max(region.row_start, piece.dst_row)
            hi = min(region.row_start + region.num_rows, piece.dst_row + piece.num_rows)
            if lo >= hi:
                continue
            local, first = shards[piece.hf_name]
            src_lo = piece.src_row + (lo - piece.dst_row)
            a, b = max(src_lo, first), min(src_lo + (hi - lo), first + local.shape[0])
            if a >= b:
                continue  # another rank owns these rows
            dst_row = lo + (a - src_lo)
            start = region.offset + (dst_row - region.row_start) * region.row_bytes
            num_bytes = (b - a) * region.row_bytes
            destination = ring[start:start + num_bytes].view(region.dtype).view(b - a, region.num_cols)
            source = local[a - first:b - first, piece.src_col:piece.src_col + piece.num_cols].detach()
            copies.append(Copy(worker, ring, start, num_bytes, destination, source))
    return copies


def profile_copies(copies: list[Copy], *, repeats: int = 5) -> dict:
    """Where one writer's time goes, for `colocate bench sync`: the copies of a sync replayed `repeats` times,
    each timed alone, split by the layout of their source. A copy whose source rows are contiguous is a plain
    cast (its cost above the cast floor is the number of calls); one whose source is a column slice of the
    trainer's rows (a row-parallel weight cut for TP) reads strided memory. Then the checksum of every written
    range, the read a ring or gather sync adds (in place has none). Medians over the repeats, in seconds."""
    strided = [not c.source.is_contiguous() for c in copies]
    per_pass: list[tuple[float, float, float]] = []
    with torch.no_grad():
        run_copies(copies, checksum=False)  # warm: the pages are resident, the kernels loaded
        for _ in range(repeats):
            contiguous_s = strided_s = 0.0
            for copy, is_strided in zip(copies, strided):
                started = time.perf_counter()
                copy.destination.copy_(copy.source)
                if copy.ring.is_cuda:
                    torch.cuda.synchronize(copy.ring.device)
                seconds = time.perf_counter() - started
                if is_strided:
                    strided_s += seconds
                else:
                    contiguous_s += seconds
            started = time.perf_counter()
            range_checksums([c.ring[c.start:c.start + c.num_bytes] for c in copies])
            per_pass.append((contiguous_s, strided_s, time.perf_counter() - started))
    contiguous_s, strided_s, checksum_s = (statistics.median(p[i] for p in per_pass) for i in range(3))
    return {"num_copies": len(copies), "num_strided_copies": sum(strided),
            "contiguous_bytes": sum(c.num_bytes for c, s in zip(copies, strided) if not s),
            "strided_bytes": sum(c.num_bytes for c, s in zip(copies, strided) if s),
            "contiguous_s": contiguous_s, "strided_s": strided_s, "checksum_s": checksum_s}
