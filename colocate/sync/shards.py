"""Gather on the trainer side: each rank writes its own FSDP2 shard straight into the shared bucket.

FSDP2 shards every parameter on dim 0, so the full tensor is the concatenation of the ranks' local shards, and
in row-major memory rank r's shard is one contiguous byte range of the full tensor. On one node every rank can
therefore write its rows at their offset in the bucket and the bucket then holds the full tensor: a gather with
no collective and every byte written once (gloo's all-gather moves ~0.6 GB/s here; a memcpy ~9 GB/s).

    checksums = write_bucket(plan, index, local_shards(params), ring)   # every rank, concurrently, disjoint byte ranges

Two layouts (see reshard.SyncPlan): "sliced" writes, for every engine worker, only that worker's TP slice in
its parameters' layout (each byte of the engine's weights written once, no loader on the other side); "full"
writes whole HF tensors for vLLM's `load_weights` to slice.

Ranks on other nodes cannot map the bucket; they would all-gather (`DTensor.full_tensor()`) to a rank that
can. Not needed while trainers and engines share one node.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

from colocate.sync.buckets import Bucket, Region
from colocate.sync.reshard import Piece, SyncPlan
from colocate.sync.transport import range_checksum


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
        num_cols = math.prod(param.shape[1:])  # of the full tensor: a rank may hold zero rows
        shards[name] = (local.reshape(local.shape[0] if local.dim() else 1, num_cols), first)
    return shards


def write_local_shards(bucket: Bucket, shards: dict[str, tuple[torch.Tensor, int]],
                       ring: torch.Tensor) -> list[tuple[int, int]]:
    """Write this rank's rows of every tensor in `bucket` (cast to the bucket dtype); returns the
    (start, num_bytes) of each byte range written."""
    written = []
    with torch.no_grad():
        for packed in bucket.tensors:
            local, first_row = shards[packed.spec.name]
            if local.numel() == 0:  # more ranks than rows: this rank holds nothing of it
                continue
            dtype = packed.spec.dtype
            row_bytes = local.shape[1] * dtype.itemsize
            start = packed.offset + first_row * row_bytes
            num_bytes = local.numel() * dtype.itemsize
            destination = ring[start:start + num_bytes].view(dtype).view(local.shape)
            destination.copy_(local.detach())  # the cast to the engine dtype happens in this copy
            written.append((start, num_bytes))
    return written


def write_bucket(plan: SyncPlan, index: int, shards: dict[str, tuple[torch.Tensor, int]],
                 rings: list[torch.Tensor], *, checksum: bool = True) -> list[tuple[int, int, int, int]]:
    """Write this rank's part of bucket `index` into the engine workers' rings (`rings[w]`: worker w's; several
    workers may share one ring, which is then written once). Returns (worker, start, num_bytes, checksum) of
    every byte range written, for the workers to verify before they load (none when `checksum` is off)."""
    bucket = plan.buckets[index]
    written = []  # (worker, ring, ranges)
    if plan.mode == "full":
        seen = set()
        for worker, ring in enumerate(rings):
            if ring.data_ptr() not in seen:  # a shared ring (CPU): one copy, tagged with its first worker
                seen.add(ring.data_ptr())
                written.append((worker, ring, write_local_shards(bucket, shards, ring)))
    else:
        for worker, ring in enumerate(rings):
            written.append((worker, ring, write_sliced(bucket.regions[worker], plan.pieces[worker], shards, ring)))
    if rings[0].is_cuda:
        torch.cuda.synchronize()  # the engine workers read these bytes from other processes
    if not checksum:
        return []
    return [(worker, start, n, range_checksum(ring[start:start + n]))
            for worker, ring, ranges in written for start, n in ranges]


def write_sliced(regions: tuple[Region, ...], pieces: dict[str, list[Piece]],
                 shards: dict[str, tuple[torch.Tensor, int]], ring: torch.Tensor) -> list[tuple[int, int]]:
    """For one worker's regions of a bucket, write the rows this rank owns of every piece that lands there:
    engine rows [lo, hi) of a region <- HF rows of the piece, restricted to this rank's FSDP2 rows."""
    written = []
    with torch.no_grad():
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
                destination.copy_(local[a - first:b - first, piece.src_col:piece.src_col + piece.num_cols])
                written.append((start, num_bytes))
    return written
