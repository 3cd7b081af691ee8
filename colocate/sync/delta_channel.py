"""Lossless delta sync over the split placement's broadcast (sync.delta; docs/delta.md): each side keeps a weight
store, the bytes of every bucket slice it last sent or received, in host memory, and a sync sends per slice only
what changed since, encoded by sync/delta.py, applied by selective overwrite. No arithmetic on the engine side.

    sender = DeltaSender(channel, element_size=2)        # a feeder's, one per TP rank it feeds (sync/broadcast.py)
    sender.send(index, staging_slice)                    # the slice's delta against the store, or the slice whole
    receiver = DeltaReceiver(channel, element_size=2)    # an engine worker's
    receiver.receive(index, ring_slice)                  # the ring slice now holds the feeder's bytes, bit for bit

A slice travels as a header (int64: kind, the store version it was taken against, the new version, the payload's
bytes, the changed elements, the 4-byte gaps, compressed) and then either its payload or the slice whole: the
first sync (nothing stored), and any slice whose delta would be as large (`Delta.full`). The receiver refuses a
delta taken against another version than the one it holds (a missed or repeated sync would otherwise apply
changes to the wrong base, silently): the store's version equals the engine's after every sync. What the load
checks next is unchanged: the feeder's checksums of the staged bytes, against the ring slot's (sync/load.py), so
a delta applied wrong is caught there, as a torn write is.

Why host memory: the store is the whole model's slice for the TP ranks a side holds (the engine dtype's bytes),
which on a GPU would compete with the engine's KV cache and the trainer's state. Its bytes are in the preflight's
host side. The feeder compares on the host, after one copy of the staged slice (D2H on a GPU).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from colocate.sync.delta import Delta, apply, encode

FULL, DELTA = 0, 1
HEADER = 7  # kind, base version, version, payload bytes, changed elements, 4-byte gaps, compressed
_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def uses_delta(setting: str, *, method: str, adapter_only: bool) -> bool:
    """sync.delta's rule: true where asked (the config's checks refuse it where it cannot run), and under auto on
    the split placement's broadcast, unless the sync carries a LoRA job's adapters alone (each changes every step)."""
    return setting == "true" or (setting == "auto" and method == "broadcast" and not adapter_only)


class DeltaMismatch(RuntimeError):
    """A delta taken against another store version than the receiver holds."""


@dataclass
class DeltaStats:
    """One sync's figures on one side, summed over its slices."""

    elements: int = 0
    changed: int = 0
    sent_bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0
    full_slices: int = 0

    def __add__(self, other: DeltaStats) -> DeltaStats:
        return DeltaStats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def record(self) -> dict:
        return {**dataclasses.asdict(self), "density": self.changed / max(self.elements, 1),
                "sent_fraction": self.sent_bytes / max(self.full_bytes, 1)}


def element_view(data: torch.Tensor, element_size: int) -> torch.Tensor:
    """A uint8 slice as integers of the engine dtype's width (bits compared and coded per weight, not per byte);
    bytes where the slice does not divide into them."""
    if data.numel() % element_size or data.storage_offset() % element_size:
        return data
    return data.view(_VIEWS[element_size])


class WeightStore:
    """The last synced bytes of each bucket slice one side holds, and the version they belong to."""

    def __init__(self, pinned: bool = False):
        self.slices: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        self.pinned = pinned

    def put(self, index: int, data: torch.Tensor, version: int) -> None:
        held = self.slices.get(index)
        if held is None or held.numel() != data.numel():
            held = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=self.pinned)
            self.slices[index] = held
        held.copy_(data.reshape(-1))
        self.versions[index] = version

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.slices.values())

    @property
    def version(self) -> int:
        """The version every slice holds (-1: none stored; they always agree after a whole sync)."""
        held = set(self.versions.values())
        assert len(held) <= 1, f"the store's slices belong to different versions: {sorted(held)}"
        return held.pop() if held else -1


class DeltaSender:
    def __init__(self, channel, *, element_size: int, pinned: bool = False):
        self.channel, self.element_size = channel, element_size
        self.store = WeightStore(pinned)
        self.stats = DeltaStats()

    def send(self, index: int, data: torch.Tensor, *, version: int) -> None:
        """Slice `index` (uint8, on the channel's device) as version `version`: its delta against the store, or
        whole. A collective of the slice's broadcast group, as the plain broadcast is."""
        started = time.perf_counter()
        host = data.cpu()  # the tensor itself on the CPU; one copy from a GPU
        elements = element_view(host, self.element_size)
        base = self.store.versions.get(index, -1)
        delta = encode(element_view(self.store.slices[index], self.element_size), elements) if base >= 0 else None
        self.stats.encode_s += time.perf_counter() - started
        count = delta.count if delta is not None else elements.numel()
        self.stats.elements += elements.numel()
        self.stats.changed += count
        self.stats.full_bytes += host.numel()
        whole = delta is None or delta.full
        header = torch.tensor([FULL if whole else DELTA, base, version, 0 if whole else len(delta.payload),
                               count, 0 if whole else delta.num_large, int(not whole and delta.compressed)],
                              dtype=torch.int64, device=data.device)
        self.channel.broadcast(header)
        if whole:
            self.channel.broadcast(data)
            self.stats.sent_bytes += data.numel() + 8 * HEADER
            self.stats.full_slices += 1
        else:
            payload = torch.tensor(bytearray(delta.payload), dtype=torch.uint8).to(data.device)
            self.channel.broadcast(payload)
            self.stats.sent_bytes += payload.numel() + 8 * HEADER
        self.store.put(index, host, version)

    def resend(self, index: int, data: torch.Tensor) -> None:
        """Slice `index` whole, as the store holds it, at the store's version: for members whose store is empty (an
        engine that restarted: fault.engine_restarts). `data`: the store's bytes where the channel sends from (the
        feeder's staging slot, on its device). Counted in no sync's figures: it is no sync."""
        version = self.store.versions[index]
        header = torch.tensor([FULL, -1, version, 0, data.numel(), 0, 0], dtype=torch.int64, device=data.device)
        self.channel.broadcast(header)
        self.channel.broadcast(data)

    def take_stats(self) -> DeltaStats:
        stats, self.stats = self.stats, DeltaStats()
        return stats


class DeltaReceiver:
    def __init__(self, channel, *, element_size: int, pinned: bool = False):
        self.channel, self.element_size = channel, element_size
        self.store = WeightStore(pinned)
        self.apply_s = 0.0  # the last receive's time applying what arrived: the overwrite and the copies

    def receive(self, index: int, data: torch.Tensor) -> None:
        """Slice `index` into `data` (uint8, this worker's ring slot): whole, or the store's copy with the delta
        applied, then copied in. A collective, as the sender's."""
        header = torch.zeros(HEADER, dtype=torch.int64, device=data.device)
        self.channel.broadcast(header)
        kind, base, version, nbytes, count, num_large, compressed = header.tolist()
        if kind == FULL:
            self.channel.broadcast(data)
            started = time.perf_counter()
            self.store.put(index, data.cpu(), version)
            self.apply_s = time.perf_counter() - started
            return
        held = self.store.versions.get(index, -1)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=data.device)
        self.channel.broadcast(payload)  # received before refusing: the group's members stay in step
        if held != base:
            raise DeltaMismatch(f"bucket {index}: a delta against version {base} reached a store holding version "
                                f"{held}; nothing applied")
        started = time.perf_counter()
        stored = self.store.slices[index]
        target = element_view(stored, self.element_size)
        delta = Delta(numel=target.numel(), element_size=target.element_size(), count=count,
                      payload=payload.cpu().numpy().tobytes(), num_large=num_large, compressed=bool(compressed),
                      full=False)
        apply(target, delta)
        self.store.versions[index] = version
        data.copy_(stored)
        self.apply_s = time.perf_counter() - started
