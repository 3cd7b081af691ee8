"""Trainer offload: move the trainer's parameters and optimizer state out of the device's memory and back.

    offloader = make_offloader(device, directory)
    offloader.offload(tensors)   # before the rollout: the engine gets the memory
    offloader.onload()           # before training: every tensor back, same objects, same values

- CUDA (`DeviceToHostOffload`): copies into pinned host buffers allocated once and reused every step (no
  allocation on the hot path), then releases the device storages.
- CPU (`FileOffload`): the host *is* the device, so the next tier is a file: bytes go to a file-backed mapping
  in `directory` that is unmapped at once (the page cache keeps them while memory allows, and the kernel may
  write them back and evict them under pressure), and the storages are released. The process's RSS drops by
  the trainer's state.

Both keep tensor identity: storages are resized to 0 and back (`untyped_storage().resize_`), so FSDP2's
sharded parameters (views into its padded shard buffers) and the optimizer's state dict stay valid.
Hazard: a storage shared by several tensors (FSDP2's shard buffer, tied weights) is released once, by storage.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import torch

from colocate.memory import advise_huge_pages, return_free_memory_to_os

RETURN_EVERY_BYTES = 256 << 20  # trim the heap this often while offloading: bounds the transient double copy


def unique_storages(tensors) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


class FileOffload:
    def __init__(self, directory: str | None = None):
        fd, self.path = tempfile.mkstemp(prefix="colocate-offload-", suffix=".bin", dir=directory)
        os.close(fd)
        # The name goes at once: the open descriptor keeps the file alive, and no crash can leave it behind.
        self._fd = os.open(self.path, os.O_RDWR)
        os.unlink(self.path)
        self._held: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, bytes, file offset

    def offload(self, tensors) -> int:
        storages = unique_storages(tensors)
        total = sum(s.nbytes() for s in storages)
        if not total:
            return 0
        os.ftruncate(self._fd, total)
        mapping, mapped = _map(self._fd, total)
        offset, unreturned = 0, 0
        for storage in storages:
            num_bytes = storage.nbytes()
            mapped[offset:offset + num_bytes].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            self._held.append((storage, num_bytes, offset))
            storage.resize_(0)
            # Hazard (doubling): until the file's pages leave this mapping and the freed storage leaves the heap,
            # the state is resident twice; measured on the bench preset, +1.7 GB per rank at the end of a naive
            # copy-all-then-release. Drop both as we go (the written pages stay in the page cache).
            _drop_pages(mapping, offset, num_bytes)
            unreturned += num_bytes
            if unreturned >= RETURN_EVERY_BYTES:
                return_free_memory_to_os()
                unreturned = 0
            offset += num_bytes
        del mapped
        mapping.close()  # unmap: the bytes live in the file (page cache), not in this process
        return_free_memory_to_os()
        return total

    def onload(self) -> int:
        if not self._held:
            return 0
        total = sum(n for _, n, _ in self._held)
        mapping, mapped = _map(self._fd, total)
        for storage, num_bytes, offset in self._held:
            storage.resize_(num_bytes)
            advise_huge_pages(storage.data_ptr(), num_bytes)  # fewer, cheaper page faults on the way in
            torch.empty(0, dtype=torch.uint8).set_(storage).copy_(mapped[offset:offset + num_bytes])
        del mapped
        mapping.close()
        self._held = []
        return total

    def close(self) -> None:
        os.close(self._fd)


def _map(fd: int, num_bytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    mapping = mmap.mmap(fd, num_bytes)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def _drop_pages(mapping: mmap.mmap, offset: int, num_bytes: int) -> None:
    """Take the whole pages of [offset, offset + num_bytes) out of this process's mapping (their contents stay in
    the file)."""
    start = (offset + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    end = (offset + num_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class DeviceToHostOffload:
    def __init__(self):
        # Pinned buffers, one per storage in the (stable) order the trainer lists its tensors; allocated on the
        # first offload and reused. Not keyed by data_ptr: a storage restored by resize_ has a new address.
        self._host: list[torch.Tensor] = []
        self._held: list[tuple[torch.UntypedStorage, int]] = []

    def offload(self, tensors) -> int:
        total = 0
        for key, storage in enumerate(unique_storages(tensors)):
            num_bytes = storage.nbytes()
            if key == len(self._host):
                self._host.append(torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True))
            host = self._host[key]
            assert host.numel() == num_bytes, "the trainer's tensors changed size between steps"
            host.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), non_blocking=True)
            self._held.append((storage, key))
            total += num_bytes
        torch.cuda.synchronize()
        for storage, _ in self._held:
            storage.resize_(0)
        torch.cuda.empty_cache()
        return total

    def onload(self) -> int:
        total = 0
        for storage, key in self._held:
            host = self._host[key]
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host, non_blocking=True)
            total += host.numel()
        torch.cuda.synchronize()
        self._held = []
        return total

    def close(self) -> None:
        self._host.clear()


def make_offloader(device: torch.device, directory: str | None = None):
    return DeviceToHostOffload() if device.type == "cuda" else FileOffload(directory)
