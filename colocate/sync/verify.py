"""Ring checksums, engine side: find the byte ranges of a bucket that differ from what the trainers wrote, and
name the tensors they belong to.

The trainers checksum every range they write (`shards.run_copies`: per copy through the ring, per tensor of the
bucket in the gather protocol) and the checksums reach the engine worker as the load's arguments. The worker
checksums the same ranges of its ring before it copies anything out (sync/load.py `verify_then_load`): a byte
that changed in between (a torn or stale write, a slot reused too early, a bit flip) fails the sync with the
tensor's name, and the corrupted bytes never reach the parameters.

    bad = mismatched_ranges(ring, checksums, worker)           # [(start, num_bytes, got, expected)]
    error = corruption_error(plan, worker, bad, index=3, engine=0)

Every range a trainer checksums lies inside one tensor's span of the bucket (`tensor_spans`): a region of an
engine parameter (sliced plan) or a packed HF tensor (full plan), so an offset names its tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colocate.sync.reshard import SyncPlan, as_2d
from colocate.sync.buffers import range_checksums

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Span:
    """One tensor's bytes in a worker's ring (or weight arena): rows [row_start, ...) of `name`."""

    start: int
    num_bytes: int
    name: str
    row_start: int
    row_bytes: int


def tensor_spans(plan: SyncPlan, index: int, worker: int) -> list[Span]:
    """The tensor spans of bucket `index` in worker `worker`'s ring: engine-parameter regions (sliced plan) or
    whole HF tensors (full plan: the workers read the same tensors)."""
    bucket = plan.buckets[index]
    if plan.mode == "full":
        return [Span(t.offset, t.spec.num_bytes, t.spec.name, 0,
                     t.spec.num_bytes // as_2d(t.spec.shape)[0] if t.spec.shape else t.spec.num_bytes)
                for t in bucket.tensors]
    return [Span(r.offset, r.num_bytes, r.engine_name, r.row_start, r.row_bytes) for r in bucket.regions[worker]]


def mismatched_ranges(ring: torch.Tensor, checksums: list[tuple[int, int, int, int]],
                      worker: int) -> list[tuple[int, int, int, int]]:
    """(start, num_bytes, checksum now, checksum written) of worker `worker`'s ranges whose bytes changed since
    the trainers wrote them; one transfer for all of them. A ring shared by several workers is written once,
    under the first worker's index: pass 0 then (every sharing worker checks it, since every one loads it)."""
    mine = [(start, num_bytes, expected) for w, start, num_bytes, expected in checksums if w == worker]
    actual = range_checksums([ring[start:start + num_bytes] for start, num_bytes, _ in mine])
    return [(start, num_bytes, got, expected) for (start, num_bytes, expected), got in zip(mine, actual)
            if got != expected]


def describe_range(plan: SyncPlan, worker: int, start: int, num_bytes: int, *, index: int | None = None) -> str:
    """'<tensor> rows [a, b)' for a range of bucket `index` (None: of any bucket, in place), with the trainer's
    tensor when the engine's is a fused one (qkv_proj, gate_up_proj)."""
    indices = [index] if index is not None else range(len(plan.buckets))
    for i in indices:
        for span in tensor_spans(plan, i, worker):
            if span.start <= start < span.start + span.num_bytes:
                first = span.row_start + (start - span.start) // span.row_bytes
                last = span.row_start + -(-(start + num_bytes - span.start) // span.row_bytes)
                sources = _sources(plan, worker, span.name, first, last)
                return f"{span.name} rows [{first}, {last})" + (f" (the trainer's {', '.join(sources)})"
                                                                 if sources and sources != [span.name] else "")
    return f"bytes [{start}, {start + num_bytes}) (no tensor of the plan: a misplaced write)"


def _sources(plan: SyncPlan, worker: int, engine_name: str, first: int, last: int) -> list[str]:
    if plan.mode == "full":
        return []
    pieces = plan.pieces[worker].get(engine_name, ())
    return list(dict.fromkeys(p.hf_name for p in pieces if p.dst_row < last and first < p.dst_row + p.num_rows))


def corruption_error(plan: SyncPlan, worker: int, bad: list[tuple[int, int, int, int]], *, index: int | None,
                     engine: int | None) -> str:
    """The one-line error for mismatched ranges `bad` of bucket `index` (None: an in-place sync)."""
    start, num_bytes, got, expected = bad[0]
    where = f"engine {engine}" if engine is not None else "the engine"
    what = f"bucket {index} ({plan.buckets[index].group}) of {where}" if index is not None else \
        f"the in-place sync of {where}"
    text = (f"weight sync: {what} (TP rank {worker}) arrived corrupted in "
            f"{describe_range(plan, worker, start, num_bytes, index=index)} "
            f"(checksum 0x{got & MASK64:016x}, expected 0x{expected & MASK64:016x})")
    if len(bad) > 1:
        others = dict.fromkeys(describe_range(plan, worker, s, n, index=index).split(" rows ")[0]
                               for s, n, _, _ in bad[1:])
        text += f" and in {len(bad) - 1} more range(s) ({', '.join(list(others)[:3])})"
    if index is None:  # in place the bytes are the parameters themselves: nothing was held back
        return text + "; the engine's weights are not what the trainers wrote: sync again before sampling"
    return text + "; the bucket was not loaded (its parameters keep their previous values) and the sync fails"
