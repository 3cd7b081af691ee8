"""Trainer offload through torch_memory_saver (0.0.10), with its pause/resume state kept in Python.

    offloader = MemorySaverOffload(device, tag="colocate-trainer", owner="trainer rank 3")
    with offloader.allocation_region():   # parameter shards, optimizer state
        ...
    offloader.offload(tensors)            # pause: physical memory unmapped, a host backup kept
    offloader.onload()                    # resume: checked against the device's free memory first

Why the state lives here: the package's C++ core (`csrc/core.cpp` of torch_memory_saver 0.0.10) calls `exit(1)`
on a pause of a tag already paused, on a resume of a tag not paused, and when it cannot map the memory back at
resume. Any of those would end a trainer with no Python error: Ray reports a dead actor, the job's log has
nothing to say why. So every transition is checked first and a wrong one raises `MemorySaverError`, and a
resume that cannot fit raises `DeviceMemoryShortfall` (a `JobFault`: a restart may cure it) naming the owner,
the bytes it needs and the bytes free.

What the package's source says (read from the 0.0.10 wheel, `torch_memory_saver/entrypoint.py`):
- `hook_mode="torch"` (hooks/mode_torch.py `HookUtilModeTorch`) routes the region's allocations through a
  `CUDAPluggableAllocator` over the package's own library: no LD_PRELOAD. It is set on the singleton
  (`torch_memory_saver.hook_mode = ...`), which only works before its first use (the setter writes into its
  constructor kwargs, which `_ensure_initialized` deletes: AttributeError after).
- `region(tag, enable_cpu_backup=True)` allocates from a `MemPool` keyed by (tag, backup, backend, *current
  device*): the region is entered under `torch.cuda.device(self.device)`. The host backup defaults to "pinned"
  (cudaMallocHost, exact size, not torch's caching host allocator).
- `retain_cpu_backup` is a process-wide setter on the singleton (`tms_set_retain_cpu_backup`), not a region
  argument: set, a resume keeps the host backup instead of freeing it, so the next pause writes into the same
  pinned buffer instead of pinning the trainer's whole state again (about 10 GiB per rank for a 7B model in
  fp32 with AdamW on 8 GPUs).
- `pause(tag)` / `resume(tag)` call `tms_pause` / `tms_resume`; on CUDA their return codes are not checked and
  no byte count comes back. The core pauses every allocation of the tag, and its allocations are the pool's
  segments (csrc/core.cpp `pause`: each `AllocationMetadata.size` is backed up and unmapped), so offload and
  onload both report what moves: the pool's segments (at least the storages' bytes). The first GPU run read
  onload 270,532,608 against offload 201,375,744 when offload counted the storages alone: 192 MiB of state,
  the 2 MiB segment its small tensors share, and the 64 MiB temporary of an optimizer step the test ran inside
  the region.
Hazard: the pool is torch's caching allocator over the library, so whole segments are paused, including blocks
freed inside the region (temporaries of an optimizer step run in it): allocate the state in the region, not the
work. Resume maps the pool's reserved segments back, so the free-memory check is against what the pool reserves
(`torch.cuda.MemPool.snapshot`), not only the storages offloaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from colocate.errors import DeviceMemoryShortfall, MemorySaverError
from colocate.host.storages import device_storages

# A resume needs a little more than the paused bytes: the driver's own bookkeeping of new mappings, and the
# kernels' workspace the first op after it allocates. 256 MiB, as a margin, not a measurement.
RESUME_MARGIN_BYTES = 256 << 20


# torch_memory_saver is one process-wide singleton whose C++ state is per tag: so is ours.
_PAUSED: dict[str, int] = {}
"""tag -> the bytes its resume maps back, for every tag paused in this process."""


class MemorySaverOffload:
    name = "torch_memory_saver"

    def __init__(self, device: torch.device, *, tag: str, owner: str = "this process", saver=None,
                 free_bytes: Callable[[], int] | None = None):
        """`saver`: the torch_memory_saver singleton (a unit test passes a fake). `free_bytes`: the device's
        free memory as the driver sees it (default `torch.cuda.mem_get_info(device)`)."""
        if saver is None:
            from torch_memory_saver import torch_memory_saver as saver

            try:
                saver.hook_mode = "torch"
            except AttributeError:  # already started in this process (by its owner): keep the mode it chose
                pass
            saver.retain_cpu_backup = True
        self._saver = saver
        self.device = device
        self.tag = tag
        self.owner = owner
        self._free_bytes = free_bytes or (lambda: torch.cuda.mem_get_info(self.device)[0])

    @contextlib.contextmanager
    def allocation_region(self):
        if self.tag in _PAUSED:
            raise MemorySaverError(f"{self.owner}: allocating in torch_memory_saver tag {self.tag!r} while it is "
                                   "paused; onload first")
        with torch.cuda.device(self.device), self._saver.region(tag=self.tag, enable_cpu_backup=True):
            yield

    def offload(self, tensors) -> int:
        if self.tag in _PAUSED:
            raise MemorySaverError(f"{self.owner}: torch_memory_saver tag {self.tag!r} is already paused; a second "
                                   "pause would end the process (exit(1) in its C++ core)")
        num_bytes = sum(s.nbytes() for s in device_storages(tensors, self.device))
        to_map_back = max(num_bytes, self._reserved_bytes())
        torch.cuda.synchronize(self.device)  # no kernel may still write the state when its memory is unmapped
        self._saver.pause(self.tag)
        _PAUSED[self.tag] = to_map_back
        torch.cuda.empty_cache()  # the rest of torch's cache (activations, all-gather buffers) to the driver too
        return to_map_back

    def onload(self) -> int:
        if self.tag not in _PAUSED:
            raise MemorySaverError(f"{self.owner}: torch_memory_saver tag {self.tag!r} is not paused; a resume "
                                   "would end the process (exit(1) in its C++ core)")
        need = _PAUSED[self.tag] + RESUME_MARGIN_BYTES
        free = self._free_bytes()
        if free < need:
            raise DeviceMemoryShortfall(
                f"{self.owner} cannot bring its state back on {self.device}: it needs {need / 2**30:.2f} GiB and "
                f"the device has {free / 2**30:.2f} GiB free (short by {(need - free) / 2**30:.2f} GiB): another "
                "process holds the memory (an engine that did not sleep, a stray process on the GPU)")
        self._saver.resume(self.tag)
        return _PAUSED.pop(self.tag)

    def close(self) -> None:
        # Nothing of ours to release: the pool and its backups belong to the process-wide singleton and go with
        # the process. Not resumed here: at shutdown the engine may hold the memory a resume would need.
        pass

    def _reserved_bytes(self) -> int:
        """What the tag's pool reserves on the device: whole segments, which a resume maps back whole. Read from
        the package's private pool table (0.0.10: keyed (tag, backup, disk, backend, device index)) and torch's
        `MemPool.snapshot()` segments; a release that changes either finds nothing here, and the storages'
        bytes stand alone (never an error: this only sharpens the resume check)."""
        try:
            pools = self._saver._impl._mem_pools
            return sum(segment["total_size"] for key, pool in list(pools.items())
                       if key[0] == self.tag and key[-1] == self.device.index for segment in pool.snapshot())
        except (AttributeError, KeyError, IndexError, TypeError, RuntimeError):
            return 0
