"""Reshard plan: which rows and columns of which trainer (HF) tensor land where in each engine worker's params.

vLLM's TP layout (Qwen2/Qwen3/Llama families and their MoE kin), expressed as copy pieces between 2-D views
(`as_2d`: the last dimension is the columns; a 1-D tensor is a column [n, 1]):

    engine param rows [dst_row, dst_row + num_rows)  <-  HF tensor rows [src_row, ...), cols [src_col, +num_cols)

- qkv_proj = [q rows of this rank | k rows | v rows] (KV heads replicated when fewer than TP ranks)
- gate_up_proj = [gate rows of this rank | up rows]
- o_proj, down_proj (row-parallel): all rows, this rank's column block
- embed_tokens, lm_head: this rank's block of the vocabulary padded to a multiple of 64; padding rows have no
  piece (nobody writes them); a tied lm_head reads the embeddings
- routed experts, fused (w13_weight, w2_weight, from HF's fused gate_up_proj and down_proj): the worker's
  experts (all, or its expert-parallel block), per expert [gate rows of this rank | up rows] and this rank's
  column block of down; the router (mlp.gate) is replicated. Pieces of consecutive experts merge, so expert
  parallelism without TP is one piece per tensor, and no rule makes one transfer per expert.
- a LoRA job's adapters (`<module>.lora_A.weight`, `.lora_B.weight`, into vLLM's per-sub-layer LoRA buffers):
  this rank's rows of a column-parallel B (k, v by KV head), its column block of a row-parallel A, else whole
- everything else (norms, row-parallel biases, routers): replicated

    pieces = plan_pieces(engine_params, hf_shapes, layout)   # None: unknown architecture -> load_weights path

`engine_tensor` in tp_layout.py computes the same layout independently, from full tensors; the tests hold the two
against each other and against vLLM's real parameter shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from colocate.sync.buckets import (
    Run,
    TensorSpec,
    group_by_layer,
    largest_group_bytes,
    largest_layer_bytes,
    plan_buckets,
    plan_in_place_buckets,
    plan_sliced_buckets,
)
from colocate.sync.tp_layout import (
    COLUMN_PARALLEL,
    EXPERT_LEAVES,
    VOCAB_PADDING,
    ExpertLayout,
    TPLayout,
    hf_experts_name,
    is_adapter,
)


@dataclass(frozen=True)
class Piece:
    engine_name: str
    dst_row: int
    hf_name: str
    src_row: int
    num_rows: int
    src_col: int
    num_cols: int


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view every piece, region and shard is expressed in: the last dimension is the columns, all others
    the rows (a 1-D tensor is one column). A fused expert tensor [E, N, K] is then E * N rows of K, so an
    expert's rows, a TP block of them and an FSDP2 shard of whole experts (dim 0) are all row ranges."""
    if len(shape) == 1:
        return shape[0], 1
    rows = 1
    for size in shape[:-1]:
        rows *= size
    return rows, shape[-1]


def rows_per_index(shape: tuple[int, ...]) -> int:
    """Rows of the 2-D view (as_2d) under one index of dim 0: FSDP2 shards dim 0, so its row offsets scale by it."""
    return as_2d(shape)[0] // shape[0] if shape and shape[0] else 1


def plan_pieces(engine_params: list[tuple[str, tuple[int, ...]]], hf_shapes: dict[str, tuple[int, ...]],
                layout: TPLayout) -> list[Piece] | None:
    """Pieces for one TP worker, or None when a parameter has no rule (the caller falls back to load_weights)."""
    pieces: list[Piece] = []
    for name, shape in engine_params:
        made = _pieces_for(name, hf_shapes, layout)
        if made is None:
            return None
        rows, cols = as_2d(shape)
        if any(p.num_cols != cols or p.dst_row + p.num_rows > rows for p in made) or (
                name.rpartition(".")[2] in EXPERT_LEAVES and sum(p.num_rows for p in made) != rows):
            return None  # the rule does not describe what this engine holds (e.g. padded experts): do not guess
        pieces.extend(made)
    return pieces


def _pieces_for(name: str, hf: dict[str, tuple[int, ...]], layout: TPLayout) -> list[Piece] | None:
    prefix, _, leaf = name.rpartition(".")
    rank, size = layout.tp_rank, layout.tp_size
    if leaf in EXPERT_LEAVES:
        return _expert_pieces(name, hf_experts_name(prefix, leaf), hf, layout.experts)

    def rows_block(engine: str, hf_name: str, dst: int, index: int, count: int) -> Piece:
        rows, cols = as_2d(hf[hf_name])
        block = rows // count
        return Piece(engine, dst, hf_name, index * block, block, 0, cols)

    if is_adapter(name):
        return _adapter_pieces(name, hf, layout, rows_block)

    if prefix.endswith("qkv_proj"):
        base = prefix[: -len("qkv_proj")]
        names = [f"{base}{p}_proj.{leaf}" for p in "qkv"]
        if not all(n in hf for n in names):
            return None
        q = rows_block(name, names[0], 0, rank, size)
        kv_index, kv_count = kv_block(layout)
        k = rows_block(name, names[1], q.num_rows, kv_index, kv_count)
        v = rows_block(name, names[2], q.num_rows + k.num_rows, kv_index, kv_count)
        return [q, k, v]
    if prefix.endswith("gate_up_proj"):
        base = prefix[: -len("gate_up_proj")]
        names = [f"{base}{p}_proj.{leaf}" for p in ("gate", "up")]
        if not all(n in hf for n in names):
            return None
        gate = rows_block(name, names[0], 0, rank, size)
        return [gate, rows_block(name, names[1], gate.num_rows, rank, size)]
    if prefix.endswith(("o_proj", "down_proj")) and leaf == "weight":
        if name not in hf:
            return None
        rows, cols = as_2d(hf[name])
        block = cols // size
        return [Piece(name, 0, name, 0, rows, rank * block, block)]
    if prefix.endswith(("embed_tokens", "lm_head")):
        source = name if name in hf else "model.embed_tokens.weight"  # tied lm_head
        if source not in hf:
            return None
        rows, cols = as_2d(hf[source])
        per_rank = -(-layout.vocab_size // VOCAB_PADDING) * VOCAB_PADDING // size
        first = rank * per_rank
        valid = max(0, min(per_rank, rows - first))
        return [Piece(name, 0, source, first, valid, 0, cols)] if valid else []
    if name in hf:
        rows, cols = as_2d(hf[name])
        return [Piece(name, 0, name, 0, rows, 0, cols)]
    return None


def kv_block(layout: TPLayout) -> tuple[int, int]:
    """(index, count): this rank's block of a K or V projection's rows, cut into `count` equal blocks. With fewer
    KV heads than ranks each head is replicated on tp_size / num_kv_heads ranks."""
    rank, size = layout.tp_rank, layout.tp_size
    if layout.num_kv_heads >= size:
        return rank, size
    return rank * layout.num_kv_heads // size, layout.num_kv_heads


def _adapter_pieces(name: str, hf: dict[str, tuple[int, ...]], layout: TPLayout, rows_block) -> list[Piece] | None:
    """An adapter tensor's one piece (vLLM's LoRA layers, tp_layout._adapter_tensor): this rank's rows of a
    column-parallel B (k, v by KV head), its columns of a row-parallel A, else all of it. An engine A of a larger
    rank (engine.max_lora_rank) keeps its rows past the adapter's at zero: no piece writes them."""
    if name not in hf:
        return None
    projection = name[: -len(".lora_A.weight")].rpartition(".")[2]
    rank, size = layout.tp_rank, layout.tp_size
    rows, cols = as_2d(hf[name])
    if name.endswith(".lora_B.weight") and projection in ("k_proj", "v_proj"):
        return [rows_block(name, name, 0, *kv_block(layout))]
    if name.endswith(".lora_B.weight") and projection in COLUMN_PARALLEL:
        return [rows_block(name, name, 0, rank, size)]
    if name.endswith(".lora_A.weight") and projection not in COLUMN_PARALLEL:
        return [Piece(name, 0, name, 0, rows, rank * (cols // size), cols // size)]
    return [Piece(name, 0, name, 0, rows, 0, cols)]


def _expert_pieces(name: str, hf_name: str, hf: dict[str, tuple[int, ...]],
                   experts: ExpertLayout | None) -> list[Piece] | None:
    """A fused expert tensor's pieces: per local expert, its gate and up row blocks (w13) or its column block (w2),
    merged where they follow each other in both tensors (expert parallelism without TP: one piece per tensor).
    None when the HF side is not fused the same way (per-expert tensors: the full-tensor path loads them)."""
    if experts is None or len(hf.get(hf_name, ())) != 3:
        return None
    num_experts, rows, cols = hf[hf_name]
    pieces = []
    for slot, expert in enumerate(experts.expert_ids):
        if not 0 <= expert < num_experts:
            return None
        if name.endswith("w13_weight"):  # HF rows per expert: [gate (I) | up (I)]; engine: [gate_r | up_r]
            block = rows // 2 // experts.tp_size
            for half in range(2):
                pieces.append(Piece(name, (2 * slot + half) * block, hf_name,
                                    expert * rows + half * rows // 2 + experts.tp_rank * block, block, 0, cols))
        else:  # w2: all H rows of the expert, this rank's block of the intermediate columns
            block = cols // experts.tp_size
            pieces.append(Piece(name, slot * rows, hf_name, expert * rows, rows, experts.tp_rank * block, block))
    return _merged(pieces)


def _merged(pieces: list[Piece]) -> list[Piece]:
    if not pieces:  # a worker that holds no experts
        return pieces
    out = [pieces[0]]
    for p in pieces[1:]:
        last = out[-1]
        if (p.hf_name, p.src_col, p.num_cols) == (last.hf_name, last.src_col, last.num_cols) \
                and p.dst_row == last.dst_row + last.num_rows and p.src_row == last.src_row + last.num_rows:
            out[-1] = Piece(last.engine_name, last.dst_row, last.hf_name, last.src_row,
                            last.num_rows + p.num_rows, last.src_col, last.num_cols)
        else:
            out.append(p)
    return out


def runs_for_worker(engine_params: list[tuple[str, tuple[int, ...], torch.dtype]], pieces: list[Piece]) -> list[Run]:
    """The rows of each engine parameter that pieces cover, merged into contiguous runs (model order)."""
    by_name: dict[str, list[tuple[int, int]]] = {}
    for p in pieces:
        by_name.setdefault(p.engine_name, []).append((p.dst_row, p.dst_row + p.num_rows))
    runs = []
    for name, shape, dtype in engine_params:
        _, cols = as_2d(shape)
        start = end = None
        for lo, hi in sorted(by_name.get(name, [])):
            if start is not None and lo <= end:
                end = max(end, hi)
                continue
            if start is not None:
                runs.append(Run(name, start, end - start, cols, dtype))
            start, end = lo, hi
        if start is not None:
            runs.append(Run(name, start, end - start, cols, dtype))
    return runs


@dataclass(frozen=True)
class SyncPlan:
    """Everything trainers and engine workers need to agree on, built once per engine layout and sent once;
    per bucket only its index (and checksums) cross Ray.

    Every engine worker has its own ring of `num_slots` slots (on CUDA a buffer on its GPU; on the CPU a
    shared-memory segment, one for all workers in full mode, where they read the same tensors).
    mode "sliced": a worker's slot holds its TP slice in its parameters' layout (reshard plan).
    mode "full": a slot holds full HF tensors that vLLM's `load_weights` slices (the fallback for architectures
    without a reshard plan).
    in_place (sliced only): no ring; the regions address each worker's parameters in its weight arena (CPU),
    one bucket per layer, and the engine only verifies."""

    mode: str
    slot_bytes: int
    num_slots: int
    buckets: tuple
    pieces: tuple[dict[str, list[Piece]], ...] = ()  # sliced: per worker (TP rank), engine name -> pieces
    in_place: bool = False

    @property
    def ring_bytes(self) -> int:
        """Bytes of one worker's ring (none in place: the sync writes into the parameters)."""
        return 0 if self.in_place else self.slot_bytes * self.num_slots

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)


def build_sync_plan(specs: list[TensorSpec], worker_layouts: list[dict], layout_of, *, bucket_bytes: int,
                    num_slots: int, sliced: bool = True, param_offsets: list[dict[str, int]] | None = None) -> SyncPlan:
    """The sliced plan when every worker's parameters have a rule, else the full-tensor plan.

    worker_layouts: per worker {"tp_rank", "tp_size", "params": [(name, shape, dtype_str)]};
    layout_of(tp_rank, tp_size) -> TPLayout (a worker's "experts" report, for a MoE model, is added to it);
    bucket_bytes: the slot size, 0 to fit the largest layer;
    sliced=False forces the full-tensor plan (the benchmark's baseline); param_offsets (per worker, by TP rank:
    engine name -> byte offset in its weight arena) makes a sliced plan write in place."""
    hf_shapes = {s.name: s.shape for s in specs}
    dtype = specs[0].dtype
    workers = sorted(worker_layouts, key=lambda w: w["tp_rank"])
    per_worker_pieces, per_worker_runs = [], []
    for worker in workers:
        params = [(name, tuple(shape), dtype) for name, shape, _ in worker["params"]]
        pieces = plan_pieces([(n, s) for n, s, _ in params], hf_shapes, worker_layout(worker, layout_of))
        if pieces is None or not sliced:
            groups = group_by_layer(specs)
            slot = bucket_bytes or largest_layer_bytes(specs)
            return SyncPlan("full", slot, num_slots, tuple(plan_buckets(groups, slot_bytes=slot, num_slots=num_slots)))
        per_worker_pieces.append(pieces)
        per_worker_runs.append(runs_for_worker(params, pieces))
    pieces_by_name = tuple(_by_engine_name(p) for p in per_worker_pieces)
    if param_offsets is not None:
        buckets = plan_in_place_buckets(per_worker_runs, param_offsets)
        return SyncPlan("sliced", 0, 0, tuple(buckets), pieces_by_name, in_place=True)
    slot = bucket_bytes or largest_group_bytes(per_worker_runs)
    buckets = plan_sliced_buckets(per_worker_runs, slot_bytes=slot, num_slots=num_slots)
    return SyncPlan("sliced", slot, num_slots, tuple(buckets), pieces_by_name)


def worker_layout(worker: dict, layout_of) -> TPLayout:
    """The TPLayout of an engine worker's layout report (engine/extension.py `colocate_param_layout`), with what it
    holds of a MoE model's experts as it reported them (engine/experts.py)."""
    layout = layout_of(worker["tp_rank"], worker["tp_size"])
    if experts := worker.get("experts"):
        layout = replace(layout, experts=ExpertLayout(experts["tp_rank"], experts["tp_size"],
                                                      tuple(experts["expert_ids"])))
    return layout


def _by_engine_name(pieces: list[Piece]) -> dict[str, list[Piece]]:
    out: dict[str, list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.engine_name, []).append(p)
    return out
