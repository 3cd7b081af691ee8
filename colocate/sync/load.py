"""Load: an engine worker copies its TP slice of one bucket out of its ring slot into its parameters.

    load_regions(ring, bucket.regions[tp_rank], params)   # copies, then waits for them: the slot is free after

Hazard (slot reuse, the late-load race): on CUDA `copy_` only *enqueues* a device copy and returns. The sync
hands the slot back to the trainers as soon as the load call returns (their write of bucket i + num_slots is
scheduled after it), so returning before the copies ran would let a trainer overwrite bytes the engine has not
read yet: the engine would then load a later bucket's bytes into this bucket's parameters. Checksums cannot see
it (they are computed before the copy). The load therefore synchronises its stream before it returns, as vLLM's
own packed IPC path does before it hands a buffer back (`vllm/distributed/weight_transfer/packed_tensor.py`,
vLLM 0.32: the consumer synchronises before the producer may refill the buffer).
"""

from __future__ import annotations

import torch

from colocate.sync.buckets import Region


def ring_view(ring: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`shape`-shaped `dtype` view of the ring's bytes at `offset` (no copy)."""
    numel = 1
    for size in shape:
        numel *= size
    return ring[offset:offset + numel * dtype.itemsize].view(dtype).view(shape)


def load_regions(ring: torch.Tensor, regions: tuple[Region, ...], params: dict[str, torch.Tensor]) -> None:
    """Copy every region of a bucket from the ring into the parameter rows it names, and return only once the
    copies have finished reading the ring (see the module's hazard)."""
    with torch.no_grad():
        for region in regions:
            param = params[region.engine_name]
            target = param.view(param.shape[0], -1) if param.dim() > 1 else param.view(-1, 1)
            source = ring_view(ring, region.offset, (region.num_rows, region.num_cols), region.dtype)
            target[region.row_start:region.row_start + region.num_rows].copy_(source)
    release_slot(ring)


def release_slot(ring: torch.Tensor) -> None:
    """Wait until this process's work on `ring` is done, so its slot may be handed back to the writers."""
    if ring.is_cuda:
        torch.cuda.current_stream(ring.device).synchronize()
