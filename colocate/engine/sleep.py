"""Portable engine sleep: really release the weights' and KV cache's memory, restore it on wake.

vLLM's sleep mode (CUDA) frees physical memory and keeps virtual addresses. The CPU platform has no sleep mode,
so this backend does the portable equivalent on the tensors' storages: `storage.resize_(0)` returns the bytes to
the allocator (large blocks go straight back to the OS), and `resize_(nbytes)` brings a storage of the same size
back. Tensors keep their identity, so the model, the attention layers and the KV cache bookkeeping that hold
references to them stay valid; only the contents are gone.

    sleeper = PortableSleep(model, kv_caches)
    sleeper.sleep(level=2)          # weights discarded (sync restores them), KV cache freed
    sleeper.wake(["weights"])       # storages back, ready for the weight sync to write into
    ...                             # weight sync
    sleeper.wake(["kv_cache"])      # then the KV cache: the two never need to coexist with a second copy

Level 1 keeps a host copy of the weights and writes it back on wake; on the CPU the host *is* the device, so
level 1 frees only the KV cache for real (the copy sits in the same RAM) and exists to run the same protocol as
CUDA's level 1 (weights restored by wake, not by the sync). Level 2 is the CPU's useful mode: the sync
overwrites the weights anyway.

Weights in a shared arena (in-place sync, sync/arena.py) are released by punching the arena's pages out
(`WeightArena.discard`): addresses stay, every mapping sees the pages go, and the sync's writes fault them
back in. Other storages (the KV cache, weights synced through the ring) are resized; a restored storage is
advised into transparent huge pages before anything touches it, which makes faulting it back in about 1.7x
cheaper here (300 MB: 148 ms with 4 KiB pages, 88 ms with 2 MiB pages, against 57 ms for the copy alone).

Hazards:
- Several KV cache tensors (K and V of a layer, or layers in one group) share one storage: release each storage
  once and remember its size first.
- A restored storage is allocated lazily by the OS: RSS rises again only as pages are written (the weights by
  the sync or the level-1 copy, the KV cache block by block as rollouts use it). Committing it at wake (a
  memset of the whole KV cache) cost 0.1-0.4 s per step on the default job for nothing the engine reads.
- The KV cache comes back with garbage: the engine must reset its prefix cache after wake (EngineActor does).
"""

from __future__ import annotations

import torch

from colocate.host.memory import advise_huge_pages, return_free_memory_to_os
from colocate.host.storages import unique_storages

WEIGHTS = "weights"
KV_CACHE = "kv_cache"


class PortableSleep:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], *, arena=None):
        self._model = model
        self._kv_caches = kv_caches
        self.arena = arena  # set when the weights move into a shared arena (in-place sync)
        self._released: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self._host_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def asleep(self) -> bool:
        return bool(self._released)

    def sleep(self, level: int) -> int:
        """Release weights and KV cache; returns the bytes released."""
        assert not self._released, "sleep() called twice without wake()"
        if self.arena is not None:
            if level == 1:
                self._host_copies = [(self.arena.tensor, _huge_copy(self.arena.tensor))]
            self.arena.discard()
            self._released[WEIGHTS] = [(None, self.arena.num_bytes)]
        else:
            if level == 1:
                self._host_copies = [(p, _huge_copy(p.detach())) for p in self._model.parameters()]
            self._released[WEIGHTS] = self._release(unique_storages(self._model.parameters()))
        self._released[KV_CACHE] = self._release(unique_storages(self._kv_caches))
        return_free_memory_to_os()
        return sum(n for group in self._released.values() for _, n in group)

    def wake(self, tags: list[str], *, commit: bool = False) -> int:
        """Restore the tagged memory (weights, kv_cache); returns the bytes restored. `commit` writes the KV
        cache at once (zeros), so its pages are resident as after a CUDA wake: the switch benchmark measures
        sleep on a fully resident engine; the RL loop leaves pages to come back as rollouts touch them."""
        restored = 0
        for tag in tags:
            assert tag in (WEIGHTS, KV_CACHE), tag
            for storage, num_bytes in self._released.pop(tag, []):
                if storage is None:  # the arena: its pages come back as they are written
                    restored += num_bytes
                    continue
                storage.resize_(num_bytes)
                advise_huge_pages(storage.data_ptr(), num_bytes)
                if commit and tag == KV_CACHE:
                    torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
                restored += num_bytes
            if tag == WEIGHTS and self._host_copies:
                with torch.no_grad():
                    for param, copy in self._host_copies:
                        param.copy_(copy)
                self._host_copies = []
                return_free_memory_to_os()  # the host copies, or RSS stays up (see memory.py)
        return restored

    @staticmethod
    def _release(storages: list[torch.UntypedStorage]) -> list[tuple[torch.UntypedStorage, int]]:
        released = []
        for storage in storages:
            released.append((storage, storage.nbytes()))
            storage.resize_(0)
        return released


def _huge_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in memory advised into huge pages before it is written (faster to fault in)."""
    copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    advise_huge_pages(copy.data_ptr(), copy.numel() * copy.element_size())
    return copy.copy_(tensor)
