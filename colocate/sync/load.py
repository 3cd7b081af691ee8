"""Load: an engine worker copies its TP slice of one bucket out of its ring slot into its parameters.

    verify_s, load_s, error = verify_then_load(plan, index, ring, checksums, worker=tp_rank, params=params,
                                               load_weights=model.load_weights, engine=0)
    load_regions(ring, bucket.regions[tp_rank], params)   # copies, then waits for them: the slot is free after

Order: verify every range of the bucket first (sync/verify.py), copy only if all match. A corrupted slot then
fails the sync naming the tensor while the parameters still hold their previous values, and the engine never
samples from the corrupted bytes. (Per worker: another TP worker whose own ranges matched loads its slice of the
same bucket, and earlier buckets are loaded; the sync raises, so no rollout runs on that mix.)

Hazard (slot reuse, the late-load race): on CUDA `copy_` only *enqueues* a device copy and returns. The sync
hands the slot back to the trainers as soon as the load call returns (their write of bucket i + num_slots is
scheduled after it), so returning before the copies ran would let a trainer overwrite bytes the engine has not
read yet: the engine would then load a later bucket's bytes into this bucket's parameters. Checksums cannot see
it (they are computed before the copy). The load therefore synchronises its stream before it returns, as vLLM's
own packed IPC path does before it hands a buffer back (`vllm/distributed/weight_transfer/packed_tensor.py`,
vLLM 0.32: the consumer synchronises before the producer may refill the buffer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from colocate.sync.buckets import Region
from colocate.sync.reshard import SyncPlan
from colocate.sync.verify import corruption_error, mismatched_ranges


def verify_then_load(plan: SyncPlan, index: int, ring: torch.Tensor, checksums: list[tuple[int, int, int, int]], *,
                     worker: int, params: dict[str, torch.Tensor], load_weights: Callable | None = None,
                     engine: int | None = None, shared: bool = False) -> tuple[float, float, str | None]:
    """Bucket `index` into worker `worker`: check the trainers' checksums of its ranges, then copy (sliced plan:
    into `params`; full plan: through vLLM's `load_weights`). `shared`: the engine's workers share this ring
    (full plan on the CPU), written and checksummed once under worker 0. Returns (verify seconds, load
    seconds, error or None); on an error nothing was copied."""
    started = time.perf_counter()
    # Hazard: a worker reading a shared ring must check worker 0's ranges itself; checking only its own (there
    # are none) would let it load bytes that worker 0 found corrupted.
    bad = mismatched_ranges(ring, checksums, 0 if shared else worker)
    verified = time.perf_counter()
    if bad:
        return verified - started, 0.0, corruption_error(plan, worker, bad, index=index, engine=engine)
    bucket = plan.buckets[index]
    # Hazard (buffer reuse): the views below alias a ring slot the trainers refill `num_slots` buckets later;
    # both paths copy out of it, wait for their copies (module hazard) and keep no view beyond this call.
    if plan.mode == "sliced":
        load_regions(ring, bucket.regions[worker], params)
    else:
        load_weights(weights=[(t.spec.name, ring_view(ring, t.offset, t.spec.shape, t.spec.dtype))
                              for t in bucket.tensors])
        release_slot(ring)
    return verified - started, time.perf_counter() - verified, None


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
            target = param.view(-1, param.shape[-1]) if param.dim() > 1 else param.view(-1, 1)  # reshard.as_2d
            source = ring_view(ring, region.offset, (region.num_rows, region.num_cols), region.dtype)
            target[region.row_start:region.row_start + region.num_rows].copy_(source)
    release_slot(ring)


def release_slot(ring: torch.Tensor) -> None:
    """Wait until this process's work on `ring` is done, so its slot may be handed back to the writers."""
    if ring.is_cuda:
        torch.cuda.current_stream(ring.device).synchronize()
