"""The trainer's device path through `TrainerActor`, world size 1: NCCL on the GPU, gloo on the CPU.

Train steps (bf16 compute, fp32 master state), `release_grads`, offload/onload through the configured backend
leaving the full state dict bit for bit unchanged, and the write of its shards into a full-plan ring
(`write_bucket`), compared with the state dict. The fsdp2 section of the check and tests/gpu/test_cuda_trainer.py
call `train_offload_and_write` on CUDA; the check's CPU mode calls it on gloo with the file tier, so a changed
trainer signature fails CI, not the next GPU run (the first GPU run met exactly that: a stale `train_step`).

What "freed" means per backend (what each moves is not what each counter sees):
- pinned: the storages are resized to 0 and torch's cache emptied: torch's allocated bytes fall by what moved.
- torch_memory_saver: the pool's segments are unmapped under torch's feet, so torch still counts every block as
  allocated; the driver's free memory rises by what moved (trainer/memory_saver.py).
- file (CPU): the storages are resized to 0; RSS falls only for blocks the allocator returns to the OS (a tiny
  model's are heap blocks), so the storages' sizes are what is checked, RSS is reported.
"""

from __future__ import annotations

import tempfile
import time

import torch

from colocate.bench.gpu_check.common import failure, free_bytes, free_port, run_child
from colocate.config import ModelConfig, TrainerConfig
from colocate.rl.samples import Sequence

SEQS = [Sequence([5, 6, 16], [5, 6, 2], [-3.0, -3.5, -4.0], 1.0), Sequence([7, 8, 16], [9], [-3.2], -1.0)]
STEP = dict(num_tokens_all_ranks=4, num_micro_batches=1, num_seqs_all_ranks=len(SEQS))
FREED_FRACTION = 0.9


def train_offload_and_write(model_path: str, *, device: str, backend: str, port: int) -> dict:
    """One trainer rank (world size 1) in this process: three steps, offload/onload, a ring write. Returns the
    readings and `status`; the caller's process must have no process group yet."""
    from colocate.host.memory import process_rss_bytes
    from colocate.sync.buckets import TensorSpec, group_by_layer, plan_buckets
    from colocate.sync.reshard import SyncPlan
    from colocate.sync.shards import write_bucket
    from colocate.sync.buffers import create_buffer
    from colocate.trainer.actor import TrainerActor

    cfg = TrainerConfig(micro_batch_size=2, mixed_precision=True, offload_backend=backend)
    trainer = TrainerActor(0, 1, cfg, model_path, device=device, pad_id=0)
    cuda = device == "cuda"
    try:
        t0 = time.perf_counter()
        out = {"setup": trainer.setup("127.0.0.1", port), "setup_s": time.perf_counter() - t0, "step_s": []}
        out["offloader"] = trainer._offloader.name
        losses = []
        for step in range(3):  # the first step also creates AdamW's state
            t0 = time.perf_counter()
            losses.append(trainer.train_step(SEQS, step=step, **STEP).loss_sum)
            if cuda:
                torch.cuda.synchronize()
            out["step_s"].append(time.perf_counter() - t0)
        out["losses"] = losses
        out["released_grad_bytes"] = trainer.release_grads()
        before = trainer.full_state_dict("float32")
        state = trainer._state_tensors()
        out["state_bytes"] = sum(s.nbytes() for s in {t.untyped_storage().data_ptr(): t.untyped_storage()
                                                      for t in state if t.device == trainer.device}.values())
        allocated = torch.cuda.memory_allocated() if cuda else 0
        free, rss = (free_bytes() if cuda else 0), process_rss_bytes()
        t0 = time.perf_counter()
        out["offloaded_bytes"] = trainer.offload()
        out["offload_s"] = time.perf_counter() - t0
        out["allocated_drop"] = allocated - torch.cuda.memory_allocated() if cuda else 0
        out["free_rise"] = free_bytes() - free if cuda else 0
        out["rss_drop"] = rss - process_rss_bytes()
        out["storages_released"] = all(t.untyped_storage().nbytes() == 0 for t in state if t.device.type == device)
        t0 = time.perf_counter()
        out["onloaded_bytes"] = trainer.onload()
        out["onload_s"] = time.perf_counter() - t0
        after = trainer.full_state_dict("float32")
        out["bit_exact"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        out["loss_after_onload"] = trainer.train_step(SEQS, step=3, **STEP).loss_sum

        # the shards into a full-plan ring, as the CPU's ring sync and the GPU's gather write them
        expected = trainer.full_state_dict("bfloat16")
        specs = [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in trainer.params.items()]
        slot = max(s.num_bytes for s in specs) * 8
        buckets = plan_buckets(group_by_layer(specs), slot_bytes=slot, num_slots=2)
        plan = SyncPlan("full", slot, 2, tuple(buckets))
        owner = create_buffer(plan.ring_bytes, device=trainer.device, tag="gpucheck-trainer")
        ring, wrong = owner.tensor, []
        for index, bucket in enumerate(buckets):
            write_bucket(plan, index, trainer.shards, [ring])
            for packed in bucket.tensors:
                got = ring[packed.offset:packed.offset + packed.spec.num_bytes].view(torch.bfloat16)
                if not torch.equal(got.view(packed.spec.shape).cpu(), expected[packed.spec.name]):
                    wrong.append(packed.spec.name)
        out.update(ring_buckets=len(buckets), ring_mismatches=wrong)
        del ring
        owner.unlink()
    finally:
        trainer.shutdown()
    finite = bool(torch.isfinite(torch.tensor(losses + [out["loss_after_onload"]])).all())
    out["freed"] = freed(out)
    out["status"] = "pass" if out["bit_exact"] and finite and out["freed"] and not wrong else "fail"
    return out


def freed(readings: dict) -> bool:
    """Whether the offload freed what it reported moving, by the counter its backend moves (module docstring)."""
    moved = readings["offloaded_bytes"]
    if readings["offloader"] == "file":
        return readings["storages_released"] and moved >= readings["state_bytes"] > 0
    counter = readings["allocated_drop"] if readings["offloader"] == "pinned" else readings["free_rise"]
    return counter >= FREED_FRACTION * moved > 0 and moved >= readings["state_bytes"]


def _child(model_preset: str, device: str, backend: str) -> dict:
    from colocate.models.sources import ensure_model

    with tempfile.TemporaryDirectory(prefix="gpucheck-model-") as cache_dir:
        t0 = time.perf_counter()
        path = ensure_model(ModelConfig(preset=model_preset, cache_dir=cache_dir))
        built = time.perf_counter() - t0
        out = train_offload_and_write(path, device=device, backend=backend, port=free_port())
    return {**out, "model_build_s": built}


def fsdp2_section(device: torch.device, tms: dict) -> dict:
    """One fresh process per offload backend (its own process group), so a backend that fails does not hide what
    the other shows."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return {"status": "skipped", "reason": "transformers is not installed (TrainerActor loads a HF model)"}
    if device.type == "cuda":
        backends = ["pinned", "torch_memory_saver"]
    else:
        backends = ["auto"]  # the CPU's file tier, whatever the backend says (trainer/offload.py select_backend)
    out = {"process_group": "nccl" if device.type == "cuda" else "gloo"}
    for backend in backends:
        if backend == "torch_memory_saver" and not tms["available"]:
            out[backend] = {"status": "skipped", "reason": tms["reason"]}
            continue
        try:
            out[backend] = run_child(_child, "tiny", device.type, backend, timeout=300)
        except Exception:
            out[backend] = failure()
    statuses = [out[b]["status"] for b in backends]
    out["status"] = "fail" if "fail" in statuses else "pass"
    return out
