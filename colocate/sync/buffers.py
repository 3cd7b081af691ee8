"""Buffers: one persistent byte buffer shared between trainer ranks and engine workers.

The buffer is allocated once per engine (or per engine worker on CUDA) and mapped by every party; per bucket
only small metadata moves over the control channel. Two implementations with one protocol:

- `ShmBuffer` (CPU): a POSIX shared-memory segment in /dev/shm, mapped with mmap.
- `CudaIpcBuffer` (GPU): a device allocation exported with a CUDA IPC handle (`reduce_tensor`).

    owner = ShmBuffer.create(num_bytes, tag="e0")   # engine side, once
    handle = owner.handle                           # small and picklable: send it to the other parties
    view = attach(handle)                           # in a trainer rank / engine worker: a uint8 tensor
    ...
    owner.unlink()                                  # once everyone has attached: the name goes away,
                                                    # the memory stays until the last mapping closes

Hazard (leaks): a named segment outlives a crashed process. We unlink the name as soon as every party has
attached, so from then on the kernel frees the memory when the last mapping process exits, whatever way it
exits. Between create and unlink the name carries the owner's pid, and host/shm.py `remove_stale_segments`
deletes segments whose owner is dead. The names, the job token in them and what else lives in /dev/shm:
host/shm.py.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from colocate.host.shm import SHM_DIR, segment_name


@dataclass(frozen=True)
class ShmHandle:
    name: str
    num_bytes: int


@dataclass(frozen=True)
class CudaIpcHandle:
    rebuild_args: tuple  # from torch.multiprocessing.reductions.reduce_tensor
    device_uuid: str  # the physical GPU; device *indices* differ between actors (CUDA_VISIBLE_DEVICES)
    num_bytes: int


class ShmBuffer:
    """Owner side of a shared-memory segment (CPU transport)."""

    def __init__(self, name: str, num_bytes: int, mapping: mmap.mmap, fd: int):
        self.name = name
        self.num_bytes = num_bytes
        self.mapping = mapping
        self._fd = fd  # kept open: the segment's resident size is read from it, also after unlink
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)

    @classmethod
    def create(cls, num_bytes: int, *, tag: str) -> ShmBuffer:
        assert num_bytes > 0
        name = segment_name(tag)
        # O_EXCL: never adopt a file someone else created under this name; 0600: only this user maps it
        # (the umask can only remove bits, so the mode is exactly 0600).
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            mapping = mmap.mmap(fd, num_bytes)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, num_bytes, mapping, fd)

    def resident_bytes(self) -> int:
        """Bytes of memory the segment holds now. A process's RSS counts only the pages it touched itself:
        an engine worker never reads the embedding rows of tokens it was not asked about, though the trainers
        wrote them."""
        return os.fstat(self._fd).st_blocks * 512

    def __del__(self):
        os.close(self._fd)

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(self.name, self.num_bytes)

    def unlink(self) -> None:
        (SHM_DIR / self.name).unlink(missing_ok=True)


def create_buffer(num_bytes: int, *, device: torch.device, tag: str) -> ShmBuffer | CudaIpcBuffer:
    """The owner side of a ring: POSIX shared memory on the CPU, a device allocation shared by IPC on CUDA."""
    if device.type == "cuda":
        return CudaIpcBuffer.create(num_bytes, device=device)
    return ShmBuffer.create(num_bytes, tag=tag)


def attach(handle: ShmHandle | CudaIpcHandle) -> torch.Tensor:
    """Map a buffer made elsewhere; returns a flat uint8 tensor over it (it keeps the mapping alive)."""
    if isinstance(handle, ShmHandle):
        fd = os.open(SHM_DIR / handle.name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            # Only a segment of this user: a name handed over the control channel must not map another
            # user's file (our own are 0600 and O_EXCL, so a match means it is ours or root's doing).
            if os.fstat(fd).st_uid != os.getuid():
                raise PermissionError(f"shared-memory segment {handle.name} belongs to another user")
            mapping = mmap.mmap(fd, handle.num_bytes)
        finally:
            os.close(fd)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=handle.num_bytes)
    return _attach_cuda(handle)


def range_checksum(data: torch.Tensor) -> int:
    """Cheap checksum of a byte range at memory bandwidth on either device: the wrapping int64 sum of its 8-byte
    words (the unaligned head and tail bytes summed one by one). It catches torn, stale or misplaced writes; it is
    no cryptographic hash. Both sides of the sync checksum the same ring offsets, so they split words alike.
    (zlib.crc32 runs at ~4 GB/s here and an int16 sum at ~0.4 GB/s: both would cost more than the copy.)"""
    return int(_checksum(data).item())


def range_checksums(ranges: list[torch.Tensor]) -> list[int]:
    """`range_checksum` of several ranges of one device, read back in one transfer (on CUDA each `.item()` is a
    synchronising copy)."""
    if not ranges:
        return []
    return torch.stack([_checksum(r) for r in ranges]).tolist()


def _checksum(data: torch.Tensor) -> torch.Tensor:
    num_bytes = data.numel()
    head = min((-data.storage_offset()) % 8, num_bytes)
    body = (num_bytes - head) // 8 * 8
    total = data[head:head + body].view(torch.int64).sum() if body else torch.zeros((), dtype=torch.int64,
                                                                                      device=data.device)
    if head:
        total = total + data[:head].sum(dtype=torch.int64)
    if head + body < num_bytes:
        total = total + data[head + body:].sum(dtype=torch.int64)
    return total


# ---------------------------------------------------------------------------------------------------------------
# CUDA: the same protocol with an IPC handle. Kept thin; covered by tests/gpu.


class CudaIpcBuffer:
    """Owner side of a device buffer shared by CUDA IPC (engine worker allocates, trainer rank writes)."""

    def __init__(self, num_bytes: int, device: torch.device):
        self.num_bytes = num_bytes
        self.tensor = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    @classmethod
    def create(cls, num_bytes: int, *, device: torch.device) -> CudaIpcBuffer:
        return cls(num_bytes, device)

    @property
    def handle(self) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        return CudaIpcHandle(rebuild_args=args, device_uuid=device_uuid(self.tensor.device), num_bytes=self.num_bytes)

    def unlink(self) -> None:
        """Nothing to unlink: the allocation lives as long as `self.tensor` and the importers' references."""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid_str: str) -> int:
    """This process's index of the physical GPU `uuid_str` (indices are remapped by CUDA_VISIBLE_DEVICES)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid_str:
            return index
    raise RuntimeError(f"GPU {uuid_str} is not visible in this process (CUDA_VISIBLE_DEVICES mismatch)")


def _attach_cuda(handle: CudaIpcHandle) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle.rebuild_args)
    # Hazard (device remapping): argument 6 is the exporter's device index; rewrite it to ours for the same
    # physical GPU, or the handle opens on the wrong device.
    args[6] = local_device_index(handle.device_uuid)
    return rebuild_cuda_tensor(*args)
