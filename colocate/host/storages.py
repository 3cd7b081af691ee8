"""The storages under a set of tensors, each once: what offload (trainer) and sleep (engine) move or release.
Tensors that share a storage (tied weights, views, slices) must be moved once, and as one: moving their storage
keeps every view pointing at the same bytes."""

from __future__ import annotations

import torch


def unique_storages(tensors) -> list[torch.UntypedStorage]:
    """The non-empty storages of `tensors`, each once, in first-seen order."""
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


def device_storages(tensors, device: torch.device) -> list[torch.UntypedStorage]:
    """The unique non-empty storages of `tensors` that live on `device` (in first-seen order). On CUDA the
    optimizer's CPU tensors (AdamW's `step` scalars, unless fused or capturable) are not ours to move."""
    return [s for s in unique_storages(tensors) if s.device == device]
