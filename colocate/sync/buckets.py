"""Bucket plan: which tensor goes into which bucket slot at which byte offset. Pure; no torch.distributed.

Weights stream layer by layer: the pre block (embeddings), each decoder layer, the post block (final norm,
lm_head). A layer's tensors are packed into one bucket when they fit a slot, else into several (never a whole
model at once). Buckets take ring slots round-robin: bucket i uses slot i % num_slots, so the trainers can pack
bucket i + 1 while the engine loads bucket i.

    groups = group_by_layer(specs)
    buckets = plan_buckets(groups, slot_bytes=64 << 20, num_slots=2)
    for bucket in buckets: ...  # bucket.slot, bucket.tensors[k].offset (absolute, in the ring buffer)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
# Offsets are aligned so every tensor view is aligned for any dtype (and for vectorised copies).
ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    name: str  # Hugging Face parameter name, e.g. model.layers.0.self_attn.q_proj.weight
    shape: tuple[int, ...]
    dtype: torch.dtype  # the engine's dtype: what the bucket holds

    @property
    def num_bytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class PackedTensor:
    spec: TensorSpec
    offset: int  # absolute byte offset in the ring buffer


@dataclass(frozen=True)
class Bucket:
    index: int
    slot: int
    group: str  # "pre", "layer.N" or "post"
    tensors: tuple[PackedTensor, ...]

    @property
    def num_bytes(self) -> int:
        return sum(t.spec.num_bytes for t in self.tensors)


def layer_group(name: str) -> str:
    match = _LAYER_RE.search(name)
    if match:
        return f"layer.{int(match.group(1))}"
    return "pre" if "embed" in name else "post"


def group_by_layer(specs: list[TensorSpec]) -> list[tuple[str, list[TensorSpec]]]:
    """Ordered groups: pre, layer.0 .. layer.N-1, post (model order inside each group)."""
    groups: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        groups.setdefault(layer_group(spec.name), []).append(spec)
    return [(key, groups[key]) for key in sorted(groups, key=group_order)]


def group_order(group: str) -> tuple[int, int]:
    """pre, then layers by number (layer.10 after layer.2), then post."""
    if group == "pre":
        return (0, 0)
    if group == "post":
        return (2, 0)
    return (1, int(group.split(".")[1]))


def aligned(num_bytes: int) -> int:
    """`num_bytes` rounded up to a multiple of ALIGN."""
    return (num_bytes + ALIGN - 1) // ALIGN * ALIGN


def largest_layer_bytes(specs: list[TensorSpec]) -> int:
    return max(sum(aligned(s.num_bytes) for s in group) for _, group in group_by_layer(specs))


def plan_buckets(groups: list[tuple[str, list[TensorSpec]]], *, slot_bytes: int, num_slots: int) -> list[Bucket]:
    """Pack each group into as few buckets as fit `slot_bytes`; a bucket never mixes two groups."""
    buckets: list[Bucket] = []

    def close(group: str, tensors: list[TensorSpec]) -> None:
        index = len(buckets)
        slot = index % num_slots
        offset = slot * slot_bytes
        packed = []
        for spec in tensors:
            packed.append(PackedTensor(spec, offset))
            offset += aligned(spec.num_bytes)
        assert offset <= (slot + 1) * slot_bytes
        buckets.append(Bucket(index, slot, group, tuple(packed)))

    for group, specs in groups:
        current: list[TensorSpec] = []
        used = 0
        for spec in specs:
            size = aligned(spec.num_bytes)
            if size > slot_bytes:
                raise ValueError(f"tensor {spec.name} ({spec.num_bytes} bytes) is larger than a bucket slot "
                                 f"({slot_bytes} bytes): raise sync.bucket_mb")
            if used + size > slot_bytes:
                close(group, current)
                current, used = [], 0
            current.append(spec)
            used += size
        if current:
            close(group, current)
    return buckets


# ---------------------------------------------------------------------------------------------------------------
# Sliced buckets: each engine worker's slot holds only its own TP slice, in its parameters' layout.


@dataclass(frozen=True)
class Region:
    """Rows [row_start, row_start + num_rows) of one engine parameter (viewed 2-D), at `offset` in the ring."""

    engine_name: str
    row_start: int
    num_rows: int
    num_cols: int
    dtype: torch.dtype
    offset: int

    @property
    def row_bytes(self) -> int:
        return self.num_cols * self.dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.row_bytes


@dataclass(frozen=True)
class SlicedBucket:
    index: int
    slot: int  # in place: the bucket's own index (no slot is ever reused)
    group: str
    regions: tuple[tuple[Region, ...], ...]  # one tuple per engine worker (by TP rank)

    @property
    def num_bytes(self) -> int:
        return sum(r.num_bytes for worker in self.regions for r in worker)


@dataclass(frozen=True)
class Run:
    """Rows of an engine parameter that the trainer writes (padding rows are never part of a run)."""

    engine_name: str
    row_start: int
    num_rows: int
    num_cols: int
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.num_cols * self.dtype.itemsize


def _chunk(runs: list[Run], slot_bytes: int) -> list[list[Run]]:
    """Greedy packing of runs into slots by their real bytes: a run that fits the rest of the slot goes in whole;
    one that does not is split by rows at the most rows that fit, and continues in the next slot. Only a region's
    start is aligned, so each slot boundary splits at most one run."""
    chunks: list[list[Run]] = [[]]
    used = 0  # where the next region starts in the current slot (aligned)
    for run in runs:
        # Rows are contiguous in the slot: aligning each row (not just each region's start) made a 1-D tensor,
        # viewed [n, 1], count 64 bytes per element and splintered layers into thousands of tiny regions.
        row_bytes = run.num_cols * run.dtype.itemsize
        if row_bytes > slot_bytes:
            raise ValueError(f"one row of {run.engine_name} ({row_bytes} bytes) is larger than a bucket slot "
                             f"({slot_bytes} bytes): raise sync.bucket_mb")
        start, left = run.row_start, run.num_rows
        while left:
            fit = min(left, max(0, slot_bytes - used) // row_bytes)
            if fit == 0:
                chunks.append([])
                used = 0
                continue
            chunks[-1].append(Run(run.engine_name, start, fit, run.num_cols, run.dtype))
            used = aligned(used + fit * row_bytes)
            start, left = start + fit, left - fit
    return [c for c in chunks if c]


def group_runs(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(layer_group(run.engine_name), []).append(run)
    return [(g, groups[g]) for g in sorted(groups, key=group_order)]


def largest_group_bytes(worker_runs: list[list[Run]]) -> int:
    """The slot that holds every worker's share of any layer group whole: `_chunk` starts each region at an
    aligned offset, so a group needs at most the sum of its runs' aligned sizes (one region per run)."""
    return max(sum(aligned(r.num_bytes) for r in runs) for worker in worker_runs for _, runs in group_runs(worker))


def plan_sliced_buckets(worker_runs: list[list[Run]], *, slot_bytes: int, num_slots: int) -> list[SlicedBucket]:
    """Buckets over all workers at once: bucket i holds the same layer's slices for every worker, each worker's
    part in slot i % num_slots of that worker's own ring (offsets are within the worker's ring)."""
    num_workers = len(worker_runs)
    per_worker = [dict(group_runs(runs)) for runs in worker_runs]
    groups = [g for g, _ in group_runs([r for runs in worker_runs for r in runs])]
    buckets: list[SlicedBucket] = []
    for group in groups:
        chunked = [_chunk(per_worker[w].get(group, []), slot_bytes) for w in range(num_workers)]
        for k in range(max(len(c) for c in chunked)):
            index = len(buckets)
            slot = index % num_slots
            regions = []
            for w in range(num_workers):
                offset = slot * slot_bytes
                worker_regions = []
                for run in chunked[w][k] if k < len(chunked[w]) else []:
                    worker_regions.append(Region(run.engine_name, run.row_start, run.num_rows, run.num_cols,
                                                 run.dtype, offset))
                    offset += aligned(run.num_bytes)
                regions.append(tuple(worker_regions))
            buckets.append(SlicedBucket(index, slot, group, tuple(regions)))
    return buckets


def plan_in_place_buckets(worker_runs: list[list[Run]], worker_offsets: list[dict[str, int]]) -> list[SlicedBucket]:
    """One bucket per layer group whose regions address the engine workers' parameters themselves (their byte
    offset in the worker's weight arena): the trainers write in place, nothing is staged or copied after."""
    num_workers = len(worker_runs)
    per_worker = [dict(group_runs(runs)) for runs in worker_runs]
    groups = [g for g, _ in group_runs([r for runs in worker_runs for r in runs])]
    buckets = []
    for index, group in enumerate(groups):
        regions = tuple(
            tuple(Region(run.engine_name, run.row_start, run.num_rows, run.num_cols, run.dtype,
                         worker_offsets[w][run.engine_name] + run.row_start * run.num_cols * run.dtype.itemsize)
                  for run in per_worker[w].get(group, []))
            for w in range(num_workers))
        buckets.append(SlicedBucket(index, index, group, regions))
    return buckets
