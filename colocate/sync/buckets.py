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

    def order(key: str) -> tuple[int, int]:
        if key == "pre":
            return (0, 0)
        if key == "post":
            return (2, 0)
        return (1, int(key.split(".")[1]))

    return [(key, groups[key]) for key in sorted(groups, key=order)]


def _aligned(num_bytes: int) -> int:
    return (num_bytes + ALIGN - 1) // ALIGN * ALIGN


def largest_layer_bytes(specs: list[TensorSpec]) -> int:
    return max(sum(_aligned(s.num_bytes) for s in group) for _, group in group_by_layer(specs))


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
            offset += _aligned(spec.num_bytes)
        assert offset <= (slot + 1) * slot_bytes
        buckets.append(Bucket(index, slot, group, tuple(packed)))

    for group, specs in groups:
        current: list[TensorSpec] = []
        used = 0
        for spec in specs:
            size = _aligned(spec.num_bytes)
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
