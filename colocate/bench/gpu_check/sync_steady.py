"""The weight sync's steady state: the production gather writer and loader, warm-up apart, per bucket.

Nothing here re-implements the sync: a trainer rank's `GatherWriter` (sync/gather.py: cast its rows to bf16,
all-gather the layer group over a process group of world size 1, NCCL on the GPU and gloo on the CPU, copy the
worker's slice into the ring slot, checksum each tensor) and the engine worker's `verify_then_load`
(sync/load.py: verify the checksums, copy the slot into the parameters, synchronise) run bucket after bucket on a
plan from `build_sync_plan` (sync/reshard.py) over a ring from `create_buffer` (sync/buffers.py). Writer and
loader share one process and one stream: what is left out is only the messaging between the two processes
(ring_ipc measures that), which the first GPU run found to be most of its 153x.

Per model shape and slot size: the first sync is warm-up (first kernels of each kind, the gather buffers'
first touch: 13-50 ms on the H200), then `syncs` timed syncs, the weights negated between them (exact in fp32 and
bf16) so a stale slot would show. Each bucket's time (the median over the timed syncs) is one point of
time = a + b * bytes, fitted over every slot size: `a` is the per-bucket cost, 1 / b the bandwidth. A sync's
time is held against the cast floor: one fp32 -> bf16 cast of the same engine bytes in this process. The engine
holds TP=1 (one device).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from colocate.bench.gpu_check.common import copy_seconds, fit_line, free_port, run_child, sync

MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    """A Qwen2-shaped model, or only its decoder layers (`root=False`: no embeddings, final norm or lm_head)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    root: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def bench_shape() -> Shape:
    from colocate.models.sources import PRESETS

    p = PRESETS["bench"]
    return Shape(p.hidden_size, p.intermediate_size, p.num_attention_heads, p.num_key_value_heads, p.vocab_size,
                 p.num_layers)


QWEN25_7B = dict(hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)
SEVEN_B_LAYERS = Shape(**QWEN25_7B, layers=2, root=False)  # two buckets' worth at the largest slot
# the CPU's twins: the same structure at a size CI runs in a second
CPU_SHAPES = {"bench": Shape(128, 384, 4, 2, 1024, 2), "7b_layer": Shape(256, 1024, 8, 2, 1024, 2, root=False)}


def hf_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Hugging Face's parameter names and shapes (Qwen2: q/k/v with biases)."""
    h, i, hd = shape.hidden, shape.intermediate, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out = {"model.embed_tokens.weight": (shape.vocab, h)} if shape.root else {}
    for n in range(shape.layers):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                    p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    if shape.root:
        out.update({"model.norm.weight": (h,), "lm_head.weight": (shape.vocab, h)})
    return out


def engine_params(hf: dict[str, tuple[int, ...]], layout) -> list[tuple[str, tuple[int, ...], str]]:
    """vLLM's parameter names and shapes for one worker, as `colocate_param_layout` reports them (fused qkv and
    gate_up, the vocabulary padded), computed by the layout oracle on meta tensors."""
    from colocate.sync.tp_layout import VOCAB_PADDING, engine_tensor

    meta = {n: torch.empty(s, device="meta") for n, s in hf.items()}
    names = []
    for name in hf:
        if any(k in name for k in ("k_proj", "v_proj", "up_proj")):
            continue
        names.append(name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj"))
    out = []
    for name in names:
        shape = tuple(engine_tensor(name, meta, layout).shape)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = -(-layout.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
            shape = (padded // layout.tp_size, shape[1])
        out.append((name, shape, "bf16"))
    return out


def _one_slot(shape: Shape, slot_bytes: int, *, device: torch.device, syncs: int, full: dict) -> dict:
    from colocate.sync.buckets import TensorSpec
    from colocate.sync.gather import GatherWriter, plan_gather
    from colocate.sync.load import verify_then_load
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.shards import local_shards
    from colocate.sync.tp_layout import TPLayout, engine_tensor
    from colocate.sync.buffers import create_buffer

    def layout_of(rank: int, size: int) -> TPLayout:
        return TPLayout(rank, size, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab)

    layout = layout_of(0, 1)
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in full.items()]
    params = engine_params({n: tuple(t.shape) for n, t in full.items()}, layout)
    plan = build_sync_plan(specs, [{"tp_rank": 0, "tp_size": 1, "params": params}], layout_of,
                           bucket_bytes=slot_bytes, num_slots=2)
    owner = create_buffer(plan.ring_bytes, device=device, tag="gpucheck-sync")
    ring = owner.tensor
    writer = GatherWriter(plan, plan_gather(plan, specs, world_size=1), rank=0, world_size=1, device=device,
                          targets=[(0, ring)])
    engine = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s, _ in params}
    shards = local_shards(full)
    per_bucket: list[list[tuple[float, float, float]]] = [[] for _ in plan.buckets]
    sync_s, errors = [], []
    for round_ in range(1 + syncs):  # round 0: warm-up
        with torch.no_grad():
            for t in full.values():
                t.neg_()
        sync(device)
        started = time.perf_counter()
        for index in range(len(plan.buckets)):
            t0 = time.perf_counter()
            written = writer.write(index, shards)  # returns once the slot holds the bytes (run_copies syncs)
            t1 = time.perf_counter()
            verify_s, load_s, error = verify_then_load(plan, index, ring, written, worker=0, params=engine)
            errors += [error] if error else []
            if round_:
                per_bucket[index].append((t1 - t0, verify_s, load_s))
        if round_:
            sync_s.append(time.perf_counter() - started)
    hf = {n: t.to(torch.bfloat16).cpu() for n, t in full.items()}
    wrong = [n for n, value in engine.items()
             if not torch.equal(value[:engine_tensor(n, hf, layout).shape[0]].cpu(), engine_tensor(n, hf, layout))]
    engine_bytes = plan.num_bytes
    floor_s = copy_seconds(torch.empty(engine_bytes // 2, dtype=torch.bfloat16, device=device),
                           torch.ones(engine_bytes // 2, dtype=torch.float32, device=device), device)
    buckets = [{"bytes": b.num_bytes, "write_s": statistics.median(w for w, _, _ in times),
                "verify_s": statistics.median(v for _, v, _ in times),
                "load_s": statistics.median(x for *_, x in times)}
               for b, times in zip(plan.buckets, per_bucket)]
    for b in buckets:
        b["total_s"] = b["write_s"] + b["verify_s"] + b["load_s"]
    del ring, writer
    owner.unlink()
    return {"slot_bytes": plan.slot_bytes, "num_buckets": len(plan.buckets), "engine_bytes": engine_bytes,
            "sync_s_median": statistics.median(sync_s), "sync_s_all": sync_s, "cast_floor_s": floor_s,
            "ratio_to_cast_floor": statistics.median(sync_s) / floor_s, "buckets": buckets,
            "bit_exact": not wrong and not errors, "mismatched": wrong, "errors": errors}


def measure_steady_sync(device_type: str, port: int, shapes: dict, slot_sizes: dict, syncs: int) -> dict:
    """In a fresh process: a process group of world size 1, then every shape at every slot size."""
    import os

    import torch.distributed as dist

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            **({"device_id": device} if device.type == "cuda" else {}))
    out = {}
    try:
        for key, shape in shapes.items():
            gen = torch.Generator(device=device).manual_seed(0)
            full = {n: torch.randn(s, generator=gen, device=device) for n, s in hf_shapes(shape).items()}
            runs = [_one_slot(shape, slot, device=device, syncs=syncs, full=full) for slot in slot_sizes[key]]
            a, b = fit_line([(x["bytes"], x["total_s"]) for r in runs for x in r["buckets"]])
            out[key] = {"shape": asdict(shape), "fp32_bytes": sum(t.numel() * 4 for t in full.values()),
                        "runs": runs, "fit": {"per_bucket_s": a, "s_per_byte": b,
                                              "bandwidth_gb_s": (1 / b / 1e9) if b > 0 else None},
                        "bit_exact": all(r["bit_exact"] for r in runs)}
            del full
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return out


def steady_sync_section(device: torch.device, *, syncs: int = 3) -> dict:
    if device.type == "cuda":
        shapes = {"bench": bench_shape(), "7b_layer": SEVEN_B_LAYERS}
        # 0: the largest layer group (the default); the 7B layer's group is 466 MB of bf16
        slot_sizes = {"bench": [4 * MIB, 16 * MIB, 64 * MIB, 0], "7b_layer": [32 * MIB, 128 * MIB, 512 * MIB, 0]}
    else:
        shapes = CPU_SHAPES
        slot_sizes = {"bench": [64 << 10, 256 << 10, 0], "7b_layer": [256 << 10, 1 * MIB, 0]}
    out = run_child(measure_steady_sync, device.type, free_port(), shapes, slot_sizes, syncs, timeout=300)
    out["status"] = "pass" if all(v["bit_exact"] for v in out.values()) else "fail"
    out["syncs_timed"] = syncs
    return out
