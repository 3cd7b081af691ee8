"""Trainer offload: move the trainer's parameters and optimizer state out of the device's memory and back.

    offloader = make_offloader(device, backend=cfg.offload_backend, directory=cfg.offload_dir or None)
    with offloader.allocation_region():   # torch_memory_saver pauses only what was allocated in here
        shard the model; create the optimizer state
    offloader.offload(tensors)   # before the rollout: the engine gets the memory
    offloader.onload()           # before training: every tensor back, same objects, same values
    offloader.close()

Backends (`make_offloader` picks one; `select_backend` is the pure choice):
- CPU, always `FileOffload` ("file"): the host *is* the device, so the next tier is a file: bytes go to a
  file-backed mapping in `directory` that is unmapped at once (the page cache keeps them while memory allows,
  and the kernel may write them back and evict them under pressure), and the storages are released. The
  process's RSS drops by the trainer's state.
- CUDA "pinned", `PinnedOffload`: one exact-size host buffer, page-locked with cudaHostRegister, allocated on
  the first offload and reused every step; each device storage has a 64-byte aligned slice of it
  (`host_layout`). CPU-resident state (AdamW's `step` scalars) stays where it is.
- CUDA "torch_memory_saver", `MemorySaverOffload` (trainer/memory_saver.py): the package's region/pause/resume.
  Tensors keep their virtual addresses; pause unmaps the physical memory behind them after backing it up on the
  host. Its pause/resume state is kept in Python: the package's C++ core ends the process on a wrong one.
- CUDA "auto": torch_memory_saver when it is installed (and usable), else pinned.

All keep tensor identity: file and pinned resize storages to 0 and back (`untyped_storage().resize_`), so
FSDP2's sharded parameters (views into its padded shard buffers) and the optimizer's state dict stay valid;
torch_memory_saver never frees the virtual addresses at all.
Hazard: a storage shared by several tensors (FSDP2's shard buffer, tied weights) is moved once, by storage.
Hazard: between offload and onload the state must not be touched (a resized-to-0 storage crashes a reader; a
paused torch_memory_saver allocation faults on the device).
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import os
import tempfile
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from colocate.errors import ConfigError
from colocate.host.memory import advise_huge_pages, return_free_memory_to_os
from colocate.host.storages import device_storages, unique_storages

RETURN_EVERY_BYTES = 256 << 20  # trim the heap this often while offloading: bounds the transient double copy
HOST_ALIGN = 64  # byte alignment of each storage's slice of the pinned host buffer
BACKENDS = ("auto", "pinned", "torch_memory_saver")
MEMORY_SAVER_TAG = "colocate-trainer"


class Offloader(Protocol):
    name: str

    def allocation_region(self) -> AbstractContextManager:
        """Allocations made inside belong to the offloader (only torch_memory_saver needs them there)."""

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the tensors' storages off the device; returns the bytes moved."""

    def onload(self) -> int:
        """Bring back what the last offload moved (same tensor objects, same values); returns the bytes."""

    def close(self) -> None: ...


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What an FSDP2 model's owner moves out and back: this rank's parameter shards and its optimizer's state (the
    moments' local shards, and AdamW's `step` scalars)."""
    tensors = [p.to_local() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
    return tensors


def create_optimizer_state(offloader: Offloader, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's lazy state, created by hand inside the offloader's region (torch_memory_saver pauses it with the
    parameters), exactly as `Adam._init_group` creates it (torch/optim/adam.py: step a CPU scalar, the moments
    zeros like the parameter), so the step itself and its temporaries run outside the region."""
    with offloader.allocation_region():
        for group in optimizer.param_groups:
            assert not (group["fused"] or group["capturable"] or group["amsgrad"]), "mirror Adam._init_group"
            for p in group["params"]:
                optimizer.state[p].update(step=torch.tensor(0.0, dtype=torch.float32),
                                          exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                          exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))


def make_offloader(device: torch.device, *, backend: str = "auto", directory: str | None = None,
                   tag: str = MEMORY_SAVER_TAG, owner: str = "this process") -> Offloader:
    """The offloader for `device`: `backend` ("auto", "pinned", "torch_memory_saver") chooses among the CUDA
    ones; the CPU always gets the file tier in `directory` (None: the system's temporary directory).
    Hazard: torch_memory_saver pauses a whole tag at once; each offloader in a process needs its own `tag`.
    `owner` names the process in errors ("trainer rank 3")."""
    problem = memory_saver_problem() if device.type == "cuda" else None
    chosen = select_backend(device, backend=backend, memory_saver_problem=problem)
    if chosen == "file":
        return FileOffload(directory)
    if device.index is None:  # storages report "cuda:N": compare like with like (a test's "cuda")
        device = torch.device("cuda", torch.cuda.current_device())
    if chosen == "pinned":
        return PinnedOffload(device)
    from colocate.trainer.memory_saver import MemorySaverOffload

    return MemorySaverOffload(device, tag=tag, owner=owner)


def select_backend(device: torch.device, *, backend: str = "auto", memory_saver_problem: str | None) -> str:
    """The backend `device` gets for the configured `backend`: "file", "pinned" or "torch_memory_saver". Pure:
    `memory_saver_problem` is why torch_memory_saver cannot run here (`memory_saver_problem()`), or None. Raises
    ConfigError for an unknown backend, or torch_memory_saver asked for where it cannot run."""
    if backend not in BACKENDS:
        raise ConfigError(f"trainer.offload_backend={backend!r} is invalid; valid: {', '.join(BACKENDS)}")
    if device.type != "cuda":
        return "file"
    problem = memory_saver_problem
    if backend == "torch_memory_saver" and problem:
        raise ConfigError(f"trainer.offload_backend='torch_memory_saver' is invalid: {problem}; valid: auto, pinned")
    if backend == "auto":
        return "pinned" if problem else "torch_memory_saver"
    return backend


def memory_saver_problem() -> str | None:
    """Why torch_memory_saver cannot run in this process, or None."""
    # torch_memory_saver/entrypoint.py `_sanity_checks` raises at the first region() otherwise.
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return "it does not support PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    if importlib.util.find_spec("torch_memory_saver") is None:
        return "the torch-memory-saver package is not installed"
    return None


@dataclass(frozen=True)
class HostLayout:
    """Where each device storage goes in the one host buffer."""

    storages: list[torch.UntypedStorage]
    offsets: list[int]
    sizes: tuple[int, ...]
    total: int
    """Bytes of the host buffer: the end of the last slice (aligned starts, no padding after the last)."""


def host_layout(tensors, device: torch.device, *, align: int = HOST_ALIGN) -> HostLayout:
    """Pack the unique storages of `tensors` that live on `device` back to back into one host buffer, each
    slice starting at a multiple of `align`."""
    storages = device_storages(tensors, device)
    offsets, end = [], 0
    for storage in storages:
        offsets.append(-(-end // align) * align)
        end = offsets[-1] + storage.nbytes()
    return HostLayout(storages, offsets, tuple(s.nbytes() for s in storages), end)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class FileOffload:
    name = "file"

    def __init__(self, directory: str | None = None):
        fd, self.path = tempfile.mkstemp(prefix="colocate-offload-", suffix=".bin", dir=directory)
        os.close(fd)
        # The name goes at once: the open descriptor keeps the file alive, and no crash can leave it behind.
        self._fd = os.open(self.path, os.O_RDWR)
        os.unlink(self.path)
        self._held: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, bytes, file offset

    def allocation_region(self) -> AbstractContextManager:
        return contextlib.nullcontext()

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


class PinnedOffload:
    """CUDA -> one exact-size, page-locked host buffer, allocated on the first offload and reused (reallocated
    only when the device storages change, e.g. once the optimizer has created its state).

    Why not `torch.empty(..., pin_memory=True)` per storage: torch's caching host allocator rounds every block
    up to a power of two (aten/src/ATen/core/CachingHostAllocator.h, `allocate`: `roundSize` =
    `c10::llvm::PowerOf2Ceil(size)` up to `pinned_max_round_threshold`, which defaults to SIZE_MAX), so pinned
    buffers can cost up to 2x the state. Instead: one anonymous mmap of the exact total (page-aligned, pages of
    its own, so no other allocation shares a registered page), page-locked with `cudaHostRegister` through
    `torch.cuda.cudart()` (torch/csrc/cuda/shared/cudart.cpp binds cudaHostRegister/cudaHostUnregister;
    `torch.cuda.check_error` turns the returned code into a CudaError).
    """

    name = "pinned"

    def __init__(self, device: torch.device):
        self.device = device
        self._mapping: mmap.mmap | None = None
        self._host: torch.Tensor | None = None  # uint8 view of the mapping, registered with CUDA
        self._sizes: tuple[int, ...] | None = None  # the layout's storage sizes, fixed at the first offload
        self._held: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, offset, bytes

    def allocation_region(self) -> AbstractContextManager:
        return contextlib.nullcontext()

    def offload(self, tensors) -> int:
        assert not self._held, "offload twice without an onload"
        layout = host_layout(tensors, self.device)
        if not layout.total:
            return 0
        # Not keyed by data_ptr: a storage restored by resize_ has a new address; the trainer lists its tensors
        # in a stable order. The set does change once: the controller offloads before the first step (the engine
        # runs first) and AdamW creates its state at that step, so a changed layout gets a new exact-size buffer.
        if self._host is None or layout.sizes != self._sizes:
            self.close()  # the old buffer (if any) goes before the new one comes: nothing is held in it here
            self._allocate(layout.total)
            self._sizes = layout.sizes
        for storage, offset, size in zip(layout.storages, layout.offsets, layout.sizes):
            self._host[offset:offset + size].copy_(_bytes_of(storage), non_blocking=True)
            self._held.append((storage, offset, size))
        torch.cuda.synchronize(self.device)  # every copy landed before its source goes
        for storage, _, _ in self._held:
            storage.resize_(0)
        # The freed blocks go back to the driver: vLLM's wake allocates from the driver, not from torch's cache.
        # Hazard: a cached segment still holding another live tensor stays reserved.
        torch.cuda.empty_cache()
        return sum(layout.sizes)

    def onload(self) -> int:
        total = 0
        for storage, offset, size in self._held:
            storage.resize_(size)
            _bytes_of(storage).copy_(self._host[offset:offset + size], non_blocking=True)
            total += size
        torch.cuda.synchronize(self.device)  # the state is whole before anyone reads it, host buffer free again
        self._held = []
        return total

    def close(self) -> None:
        if self._host is None:
            return
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr()))
        self._host = None  # drop the tensor (it exports the mapping's buffer) before unmapping
        self._mapping.close()
        self._mapping = None

    def _allocate(self, num_bytes: int) -> None:
        self._mapping = mmap.mmap(-1, num_bytes)
        self._host = torch.frombuffer(self._mapping, dtype=torch.uint8)
        # flags 0 = cudaHostRegisterDefault; this pins (and faults in) the pages once, for the whole run
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), num_bytes, 0))
