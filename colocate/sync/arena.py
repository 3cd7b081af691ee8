"""WeightArena: an engine worker's parameters living in one shared-memory segment, written in place by the sync.

On a CPU node the engine's weights and the trainers share one memory, so the ring's second copy (trainer ->
ring slot -> parameter) is pure overhead: it doubled the bytes moved per sync. The arena moves each parameter's
storage into a POSIX shared-memory segment once, when the sync opens; the trainer ranks map it and cast their
FSDP2 rows straight into the engine's parameters at the plan's offsets. Each byte of the engine's weights is
then written exactly once per sync (the physical floor of DESIGN.md) and the sync needs no extra memory at all.

    arena = WeightArena(dict(model.named_parameters()))   # engine worker; parameters now alias the segment
    handle, offsets = arena.handle, arena.offsets           # to the plan (offsets) and the trainers (handle)
    arena.unlink()                                          # every party mapped it: the name goes away
    arena.discard()                                         # sleep: free the pages, keep the addresses

CUDA keeps the ring: the engine's weights there sit in vLLM's sleep-mode allocator (cuMem), which CUDA IPC
cannot export, and a device-to-device copy from the ring costs little next to HBM bandwidth.

Hazards:
- Parameters keep their identity (`param.data` is swapped, the Parameter object stays), so vLLM's modules and
  weight loaders keep working; a tied lm_head is the embedding's Parameter and moves with it.
- Anything that replaces a parameter's storage later (a storage resize, a `param.data =` elsewhere) silently
  detaches it from the arena, and the trainers' writes would no longer reach the engine: `detached()` checks
  every parameter's address, and the sync runs it on every verification.
- `discard()` punches the pages out of the segment: every mapping (trainers included) reads zeros afterwards
  and a later write faults fresh pages in. That is level-2 sleep (the sync rewrites every byte); level 1 keeps
  a host copy first.
"""

from __future__ import annotations

import mmap

import torch

from colocate.sync.buckets import ALIGN, aligned
from colocate.sync.buffers import ShmBuffer, ShmHandle


class WeightArena:
    def __init__(self, params: dict[str, torch.nn.Parameter], *, tag: str = "weights"):
        offsets, total = {}, 0
        for name, param in params.items():
            offsets[name] = total
            total = aligned(total + param.numel() * param.element_size())
        self.offsets = offsets
        self.buffer = ShmBuffer.create(max(total, ALIGN), tag=tag)
        self._params = params
        self.linked = True  # the segment still has its name: another party can map it
        with torch.no_grad():
            for name, param in params.items():
                view = self.view(name)
                view.copy_(param.data)
                param.data = view  # the old storage is freed here, one parameter at a time

    @property
    def handle(self) -> ShmHandle:
        return self.buffer.handle

    @property
    def num_bytes(self) -> int:
        return self.buffer.num_bytes

    @property
    def tensor(self) -> torch.Tensor:
        """The whole segment as bytes."""
        return self.buffer.tensor

    def view(self, name: str) -> torch.Tensor:
        param = self._params[name]
        start = self.offsets[name]
        flat = self.buffer.tensor[start:start + param.numel() * param.element_size()]
        return flat.view(param.dtype).view(param.shape)

    def resident_bytes(self) -> int:
        return self.buffer.resident_bytes()

    def detached(self) -> list[str]:
        """Parameters that no longer live at their arena offset (see the module's hazards)."""
        base = self.buffer.tensor.data_ptr()
        return [name for name, param in self._params.items() if param.data_ptr() != base + self.offsets[name]]

    def discard(self) -> None:
        """Free the segment's pages in every process that maps it; addresses and contents' layout stay, the
        contents read as zeros until written again."""
        self.buffer.mapping.madvise(mmap.MADV_REMOVE)

    def unlink(self) -> None:
        self.buffer.unlink()
        self.linked = False
