"""One-GPU check of colocate's CUDA path, prepared for a short loan of a GPU machine; writes one JSON.

    python3 scripts/gpu_check.py --tms-wheel wheels/torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl \
        --out $OUT/gpu_check.json                      # one H200: about 1-2 minutes, at most 5
    .venv/bin/python scripts/gpu_check.py --device cpu --size-mib 8 --out /tmp/gpu_check_cpu.json  # CPU twin, ~10 s

The GPU run is one call of the device tool: benchmarks/results/gpu/README.md says how, and where results go.

Needs torch (CUDA build), not vLLM; the FSDP2 section also needs transformers (skipped with a reason without it).
Sections, each timed and recorded as pass / fail / skipped / not_applicable; one failing does not stop the others,
and the JSON is rewritten after each one (a run cut short still leaves what it measured):

1. env             versions, device, driver, UUID, whether torch_memory_saver is importable (and how)
2. ring_ipc        the sync ring across processes as in production: this process is the engine worker (owns
                   the ring, CUDA IPC / POSIX shm), two spawned trainer ranks attach it and cast fp32 rows into
                   disjoint bf16 halves of each slot; the worker checks their checksums and `load_regions` the
                   slot, bucket after bucket; parameters must equal the fp32 sources cast to bf16, bit for bit.
                   Ratio: the whole protocol's time / one device memcpy of the same bytes.
3. late_load_race  the hazard `release_slot` guards: a load that returns before its copies ran, then the writer
                   overwrites the slot. Two streams stand for the two processes; a `_sleep` on the loader's
                   stream makes the copy surely late. The unsynchronised load must corrupt, `load_regions` never.
4. fsdp2_nccl      TrainerActor on NCCL, world size 1, bf16 params / fp32 reduce: train steps, release_grads,
                   offload/onload leaves the full state dict unchanged bit for bit.
5. offload         ~4 GiB of trainer state through `make_offloader(..., backend=pinned | torch_memory_saver)`:
                   times against a plain D2H / H2D copy into one pinned buffer, device memory freed, bit-exact.
6. memory_release  `empty_cache` hands freed blocks back to the driver (cudaMemGetInfo).
7. constants       the preflight's CUDA estimates one GPU can show (colocate/job/preflight.py): a second process's
                   CUDA context with cuBLAS (CUDA_CONTEXT_BYTES) and its NCCL communicator, world size 1
                   (NCCL_COMMUNICATOR_BYTES; 8 ranks take more), each the driver's free memory before and after,
                   read from this process while the child holds it. Not measurable here (no vLLM on the lent
                   machine): ENGINE_ASLEEP_BYTES and CUDA_GRAPH_POOL_BYTES; they are listed as such.
8. memory_saver    torch_memory_saver's guarded transitions on the GPU (trainer/memory_saver.py): a second pause,
                   a resume without a pause and a resume that cannot fit are refused with named errors and the
                   process lives on; with retain_cpu_backup a second pause adds no host memory.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import queue
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the GPU machine runs the bare working tree: colocate is not installed there
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network on the GPU machine: never try the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from colocate.config import ModelConfig, TrainerConfig  # noqa: E402
from colocate.rl.samples import Sequence  # noqa: E402
from colocate.sync.buckets import Region  # noqa: E402
from colocate.sync.load import load_regions, ring_view  # noqa: E402
from colocate.sync.transport import attach, create_buffer, range_checksum  # noqa: E402

COLS = 4096  # columns of every test parameter (8 KiB bf16 rows)
NUM_TRAINERS = 2
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU spin at ~2 GHz: the late load surely runs after the overwrite
SEQS = [Sequence([5, 6, 16], [5, 6, 2], [-3.0, -3.5, -4.0], 1.0), Sequence([7, 8, 16], [9], [-3.2], -1.0)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def elapsed(fn, device: torch.device) -> float:
    """Seconds `fn`'s work takes: cuda events around it on the GPU, the wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, device: torch.device, *, reps: int = 3) -> float:
    """The floor: best of `reps` plain copies of the same bytes, after a warm-up."""
    dst.copy_(src)
    sync(device)
    return min(elapsed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(reps))


# ------------------------------------------------------------------------------------------------ 1. env


def env_section(device: torch.device, tms: dict) -> dict:
    out = {"status": "pass", "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": socket.gethostname(), "cpu_count": os.cpu_count(),
           "torch_memory_saver": tms, "git": _git("rev-parse", "HEAD"), "git_status": _git("status", "--short")}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["transformers"] = importlib.metadata.version("transformers")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(device_name=props.name, total_memory=props.total_memory, uuid=str(props.uuid),
                   capability=f"{props.major}.{props.minor}", nccl=str(torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):  # a private binding: a missing one must not fail the section
            out["cuda_driver_api"] = torch._C._cuda_getDriverVersion()
        out["driver"] = _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0")
    return out


def _git(*argv) -> str | None:
    return _run("git", "-C", str(ROOT), *argv)


def _run(*argv) -> str | None:
    """A tool's output, or None where it is missing or fails (the GPU machine's copy of the tree has no .git)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else None
    return None


def ensure_tms(wheel: str | None) -> dict:
    """Make torch_memory_saver importable. The GPU machine has no registry, so the carried wheel is unzipped into
    a temporary directory put first on sys.path (spawned children inherit it): no pip, no write to site-packages.
    The wheel keeps its hook libraries beside the package, where the package looks for them."""
    how = "already importable"
    try:
        if importlib.util.find_spec("torch_memory_saver") is None:
            if not wheel:
                return {"available": False, "reason": "not importable and no --tms-wheel given"}
            target = tempfile.mkdtemp(prefix="tms-")
            zipfile.ZipFile(wheel).extractall(target)
            sys.path.insert(0, target)
            importlib.invalidate_caches()
            how = f"unzipped {Path(wheel).name} onto sys.path"
        import torch_memory_saver  # noqa: F401
    except Exception as e:  # a missing or broken wheel is a result to record, not a reason to stop
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    with contextlib.suppress(Exception):
        how += f", version {importlib.metadata.version('torch_memory_saver')}"
    return {"available": True, "how": how}


# ------------------------------------------------------------------------------------------- 2. ring_ipc


def _source(bucket: int, rank: int, num_rows: int, device: torch.device) -> torch.Tensor:
    """Trainer `rank`'s fp32 rows of bucket `bucket`; the engine worker regenerates them to verify."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 * bucket + rank)
    return torch.randn((num_rows, COLS), generator=gen, device=device)


def _regions(bucket: int, *, slot_bytes: int, num_slots: int, half: int) -> tuple[Region, ...]:
    base = (bucket % num_slots) * slot_bytes
    return tuple(Region(engine_name=f"bucket{bucket}", row_start=rank * half, num_rows=half, num_cols=COLS,
                        dtype=torch.bfloat16, offset=base + rank * half * COLS * 2) for rank in range(NUM_TRAINERS))


def _trainer(rank: int, handle, plan: dict, commands, results) -> None:
    """A trainer rank: attach the worker's ring, and per command cast this rank's fp32 rows of that bucket into
    its half of the bucket's slot, wait for the device, report the checksum."""
    try:
        torch.set_num_threads(1)
        ring = attach(handle)
        if ring.is_cuda:
            torch.cuda.set_device(ring.device)
        sources = {b: _source(b, rank, plan["half"], ring.device) for b in range(plan["num_buckets"])}
        sync(ring.device)
        results.put(("ready", rank, None))
        while (bucket := commands.get()) is not None:
            region = _regions(bucket, **{k: plan[k] for k in ("slot_bytes", "num_slots", "half")})[rank]
            start = time.perf_counter()
            ring_view(ring, region.offset, (region.num_rows, COLS), torch.bfloat16).copy_(sources[bucket])
            sync(ring.device)  # the worker reads the slot once told: the bytes must be there
            checksum = range_checksum(ring[region.offset:region.offset + region.num_bytes])
            results.put(("written", rank, (bucket, checksum, time.perf_counter() - start)))
        del ring  # drop the mapping before the owner frees the ring
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def _receive(results, procs, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        try:
            kind, rank, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a child process died without reporting (exit codes {dead})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message from the children in {timeout} s")
            continue
        if kind == "error":
            raise RuntimeError(f"child {rank} failed:\n{payload}")
        return kind, rank, payload


def ring_section(args, device: torch.device) -> dict:
    slot_bytes, num_slots, num_buckets = args.size_mib << 20, 2, args.num_buckets
    half = slot_bytes // (COLS * 2) // NUM_TRAINERS
    assert half > 0, "--size-mib too small"
    plan = {"slot_bytes": slot_bytes, "num_slots": num_slots, "half": half, "num_buckets": num_buckets}
    owner = create_buffer(num_slots * slot_bytes, device=device, tag="gpucheck")
    ring = owner.tensor
    params = {f"bucket{b}": torch.zeros(half * NUM_TRAINERS, COLS, dtype=torch.bfloat16, device=device)
              for b in range(num_buckets)}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    commands = [ctx.Queue() for _ in range(NUM_TRAINERS)]
    # one handle per party, as each trainer rank gets its own (CUDA IPC counts the handles it exports)
    procs = [ctx.Process(target=_trainer, args=(r, owner.handle, plan, commands[r], results))
             for r in range(NUM_TRAINERS)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            assert _receive(results, procs, 180)[0] == "ready"
        owner.unlink()  # every party has attached (a no-op for CUDA IPC)
        written: dict[int, dict[int, int]] = {b: {} for b in range(num_buckets)}
        write_s, load_s, mismatches, loaded = [], 0.0, 0, 0
        start = time.perf_counter()
        for b in range(min(num_slots, num_buckets)):
            for q in commands:
                q.put(b)
        while loaded < num_buckets:  # each trainer works in order, so buckets complete in order
            _, rank, (b, checksum, seconds) = _receive(results, procs, 120)
            written[b][rank] = checksum
            write_s.append(seconds)
            if len(written[b]) < NUM_TRAINERS:
                continue
            regions = _regions(b, slot_bytes=slot_bytes, num_slots=num_slots, half=half)
            mismatches += sum(range_checksum(ring[r.offset:r.offset + r.num_bytes]) != written[b][i]
                              for i, r in enumerate(regions))
            t0 = time.perf_counter()
            load_regions(ring, regions, params)  # returns once the copies ran: the slot is free
            load_s += time.perf_counter() - t0
            loaded += 1
            if b + num_slots < num_buckets:
                for q in commands:
                    q.put(b + num_slots)
        protocol_s = time.perf_counter() - start
    finally:
        for q in commands:  # done, or failed: the trainers wait for work, let them go
            q.put(None)
        for p in procs:
            if p.pid is not None:
                p.join(60)
            if p.is_alive():
                p.terminate()
        owner.unlink()
    exact = all(torch.equal(params[f"bucket{b}"], torch.cat([_source(b, r, half, device) for r in
                range(NUM_TRAINERS)]).to(torch.bfloat16)) for b in range(num_buckets))
    moved = num_buckets * slot_bytes
    src = torch.empty(moved, dtype=torch.uint8, device=device)
    floor_s = copy_seconds(torch.empty_like(src), src, device)
    del owner, ring, params, src
    if device.type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    exitcodes = [p.exitcode for p in procs]
    return {"status": "pass" if exact and not mismatches and exitcodes == [0] * NUM_TRAINERS else "fail",
            "bit_exact": exact, "checksum_mismatches": mismatches, "trainer_exitcodes": exitcodes,
            "transport": "cuda_ipc" if device.type == "cuda" else "shm",
            "num_trainers": NUM_TRAINERS, "num_slots": num_slots, "slot_bytes": slot_bytes,
            "num_buckets": num_buckets, "bytes": moved, "protocol_s": protocol_s, "load_s": load_s,
            "write_s_mean": sum(write_s) / len(write_s), "write_s_max": max(write_s),
            "protocol_gb_s": moved / protocol_s / 1e9, "floor_memcpy_s": floor_s,
            "floor_gb_s": moved / floor_s / 1e9, "ratio": protocol_s / floor_s}


# ------------------------------------------------------------------------------------- 3. late_load_race


def race_section(args, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"status": "not_applicable", "reason": "not applicable on CPU: copies are synchronous"}
    rows = (args.size_mib << 20) // (COLS * 2)
    ring = torch.empty(rows * COLS * 2, dtype=torch.uint8, device=device)
    slot = ring.view(torch.bfloat16).view(rows, COLS)
    first, second = (torch.randn(rows, COLS, device=device).to(torch.bfloat16) for _ in range(2))
    region = Region(engine_name="p", row_start=0, num_rows=rows, num_cols=COLS, dtype=torch.bfloat16, offset=0)
    params = {"p": torch.zeros(rows, COLS, dtype=torch.bfloat16, device=device)}
    loader, writer = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def corrupted(protected: bool, sleep: bool) -> bool:
        params["p"].zero_()
        slot.copy_(first)  # bucket i is in the slot
        torch.cuda.synchronize()
        with torch.cuda.stream(loader):  # the engine worker
            if sleep:
                torch.cuda._sleep(SLEEP_CYCLES)  # a busy stream: the copy below runs ~50 ms from now
            if protected:
                load_regions(ring, (region,), params)  # the real load: waits for its copies
            else:  # the same copy, returning at once
                params["p"].view(rows, -1)[0:rows].copy_(ring_view(ring, 0, (rows, COLS), torch.bfloat16))
        with torch.cuda.stream(writer):  # the trainer, told the slot is free: writes bucket i + num_slots
            slot.copy_(second)
        torch.cuda.synchronize()
        return not torch.equal(params["p"], first)

    trials = args.race_trials
    counts = {f"{'load_regions' if p else 'unsynchronised'}{'_sleep' if s else ''}": sum(
        corrupted(p, s) for _ in range(trials)) for p in (False, True) for s in (True, False)}
    protected_clean = counts["load_regions_sleep"] == 0 and counts["load_regions"] == 0
    hazard_shown = counts["unsynchronised_sleep"] > 0
    return {"status": "pass" if protected_clean and hazard_shown else "fail", "trials": trials,
            "corrupted": counts, "protected_clean": protected_clean, "hazard_shown": hazard_shown,
            "slot_bytes": ring.numel(), "sleep_cycles": SLEEP_CYCLES,
            "how": "one process, two streams standing for engine worker and trainer"}


# ----------------------------------------------------------------------------------------- 4. fsdp2_nccl


def _fsdp2_child(backends: list[str], cache_dir: str, results) -> None:
    """One process, one trainer per offload backend in turn (a fresh NCCL group each), so a backend that fails
    does not hide what the other shows."""
    try:
        from colocate.models.sources import ensure_model

        t0 = time.perf_counter()
        path = ensure_model(ModelConfig(preset="tiny", cache_dir=cache_dir))
        out = {"model_build_s": time.perf_counter() - t0}
        for backend in backends:
            try:
                out[backend] = _train_and_offload(path, backend)
            except Exception:
                out[backend] = _failure()
        out["status"] = "fail" if any(out[b]["status"] == "fail" for b in backends) else "pass"
        results.put(("ok", 0, out))
    except BaseException:
        results.put(("error", 0, traceback.format_exc()))


def _train_and_offload(path: str, backend: str) -> dict:
    from colocate.trainer.actor import TrainerActor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = TrainerConfig(micro_batch_size=2, mixed_precision=True, offload_backend=backend)
    trainer = TrainerActor(0, 1, cfg, path, device="cuda", pad_id=0)
    try:
        t0 = time.perf_counter()
        out = {"setup": trainer.setup("127.0.0.1", port), "setup_s": time.perf_counter() - t0, "step_s": []}
        losses = []
        for _ in range(3):  # the first step also creates AdamW's state
            t0 = time.perf_counter()
            losses.append(trainer.train_step(SEQS, num_tokens_all_ranks=4, num_micro_batches=1).loss_sum)
            torch.cuda.synchronize()
            out["step_s"].append(time.perf_counter() - t0)
        out["losses"] = losses
        out["released_grad_bytes"] = trainer.release_grads()
        before = trainer.full_state_dict("float32")
        allocated, free = torch.cuda.memory_allocated(), free_bytes()
        t0 = time.perf_counter()
        out["offloaded_bytes"] = trainer.offload()
        out["offload_s"] = time.perf_counter() - t0
        # pinned: torch's allocated bytes drop; torch_memory_saver: torch still counts them, the driver's free rises
        out["allocated_drop"] = allocated - torch.cuda.memory_allocated()
        out["free_rise"] = free_bytes() - free
        t0 = time.perf_counter()
        out["onloaded_bytes"] = trainer.onload()
        out["onload_s"] = time.perf_counter() - t0
        after = trainer.full_state_dict("float32")
        out["bit_exact"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        out["loss_after_onload"] = trainer.train_step(SEQS, num_tokens_all_ranks=4, num_micro_batches=1).loss_sum
        out["offloader"] = type(trainer._offloader).__name__
    finally:
        trainer.shutdown()
    finite = bool(torch.isfinite(torch.tensor(losses + [out["loss_after_onload"]])).all())
    freed = max(out["allocated_drop"], out["free_rise"]) >= 0.9 * out["offloaded_bytes"] > 0
    out["status"] = "pass" if out["bit_exact"] and finite and freed else "fail"
    return out


def fsdp2_section(device: torch.device, tms: dict) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA (NCCL)"}
    if importlib.util.find_spec("transformers") is None:
        return {"status": "skipped", "reason": "transformers is not installed (TrainerActor loads a HF model)"}
    backends = ["pinned"] + (["torch_memory_saver"] if tms["available"] else [])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gpucheck-model-") as cache_dir:
        proc = ctx.Process(target=_fsdp2_child, args=(backends, cache_dir, results))
        proc.start()
        try:
            out = _receive(results, [proc], 300)[2]
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.terminate()
    if not tms["available"]:
        out["torch_memory_saver"] = {"status": "skipped", "reason": tms["reason"]}
    return out


# -------------------------------------------------------------------------------------------- 5. offload


def _state_numels(num_bytes: int) -> list[int]:
    """Mixed sizes like a trainer's state: two embedding-sized tensors, 24 layer-sized, 100 small odd ones."""
    n = num_bytes // 4
    numels = [n // 4] * 2 + [n // 64] * 24
    rest = (n - sum(numels)) // 100 - 7
    return numels + [rest + i % 7 for i in range(100)]


def offload_section(args, device: torch.device, tms: dict) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA"}
    from colocate.trainer.offload import make_offloader

    numels = _state_numels(int(args.offload_gib * (1 << 30)))
    state_bytes = sum(numels) * 4
    dev_buf = torch.empty(state_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=True)
    floor = {"d2h_s": copy_seconds(host, dev_buf, device), "h2d_s": copy_seconds(dev_buf, host, device)}
    floor.update(d2h_gb_s=state_bytes / floor["d2h_s"] / 1e9, h2d_gb_s=state_bytes / floor["h2d_s"] / 1e9)
    del dev_buf, host
    torch.cuda.empty_cache()
    out = {"state_bytes": state_bytes, "num_tensors": len(numels) + 1, "floor": floor}
    for backend in ("pinned", "torch_memory_saver"):
        if backend == "torch_memory_saver" and not tms["available"]:
            out[backend] = {"status": "skipped", "reason": tms["reason"]}
            continue
        try:
            out[backend] = _measure_offloader(make_offloader(device, backend=backend), device, numels, floor)
        except Exception:
            out[backend] = _failure()
        gc.collect()
        torch.cuda.empty_cache()
    statuses = [out[b]["status"] for b in ("pinned", "torch_memory_saver")]
    out["status"] = "fail" if "fail" in statuses else "pass"
    return out


def _measure_offloader(offloader, device: torch.device, numels: list[int], floor: dict) -> dict:
    state_bytes = sum(numels) * 4
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    with offloader.allocation_region():  # torch_memory_saver can only pause what was allocated in its region
        tensors = [torch.randn(n, generator=gen, device=device) for n in numels]
    tensors.append(torch.tensor(12.0))  # AdamW's step: a CPU scalar among the device state
    expected = [t.clone() for t in tensors]
    rounds = []
    try:
        for _ in range(2):  # the first round may allocate host buffers; the second is the hot path
            before = free_bytes()
            t0 = time.perf_counter()
            moved = offloader.offload(tensors)
            torch.cuda.synchronize()
            offload_s = time.perf_counter() - t0
            freed = free_bytes() - before
            t0 = time.perf_counter()
            back = offloader.onload()
            torch.cuda.synchronize()
            onload_s = time.perf_counter() - t0
            exact = all(torch.equal(t, e) for t, e in zip(tensors, expected))
            rounds.append({"offload_s": offload_s, "onload_s": onload_s, "freed_bytes": freed,
                           "offloaded_bytes": moved, "onloaded_bytes": back, "bit_exact": exact})
    finally:
        offloader.close()
    best = rounds[-1]
    ok = all(r["bit_exact"] for r in rounds) and all(r["freed_bytes"] >= 0.95 * state_bytes for r in rounds)
    return {"status": "pass" if ok else "fail", "rounds": rounds, "freed_fraction": best["freed_bytes"] / state_bytes,
            "offload_ratio": best["offload_s"] / floor["d2h_s"], "onload_ratio": best["onload_s"] / floor["h2d_s"]}


# ------------------------------------------------------------------------------------- 6. memory_release


def memory_section(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA"}
    size = 2 << 30
    gc.collect()
    torch.cuda.empty_cache()
    free = {"before": free_bytes()}
    block = torch.empty(size, dtype=torch.uint8, device=device)
    block.fill_(1)
    free["allocated"] = free_bytes()
    del block
    free["after_del"] = free_bytes()
    torch.cuda.empty_cache()
    free["after_empty_cache"] = free_bytes()
    held = free["before"] - free["after_del"]  # the caching allocator keeps the freed block
    returned = free["after_empty_cache"] - free["after_del"]
    ok = free["before"] - free["allocated"] >= 0.99 * size and returned >= 0.99 * size
    return {"status": "pass" if ok else "fail", "bytes": size, "free": free, "held_by_cache_after_del": held,
            "returned_by_empty_cache": returned}


# -------------------------------------------------------------------------------------------- 7. constants


def _context_child(port: int, steps, results) -> None:
    """A fresh process: its CUDA context (with a cuBLAS matmul), then an NCCL communicator of world size 1,
    waiting after each for the parent to read the driver's free memory."""
    try:
        import torch.distributed as dist

        a = torch.ones(256, 256, device="cuda")
        (a @ a).sum().item()
        results.put("context")
        steps.get()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(1 << 20, device="cuda"), t)
        torch.cuda.synchronize()
        results.put("nccl")
        steps.get()
        dist.destroy_process_group()
        results.put("done")
    except BaseException:
        results.put("error: " + traceback.format_exc()[-3000:])


def constants_section(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA"}
    from colocate.job import preflight

    ctx = mp.get_context("spawn")
    steps, results = ctx.Queue(), ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    free = {"before": free_bytes()}
    child = ctx.Process(target=_context_child, args=(port, steps, results))
    child.start()
    readings = {}
    for stage in ("context", "nccl"):
        got = results.get(timeout=120)
        if got != stage:
            child.join(10)
            return {"status": "fail", "error": str(got).splitlines()[-1], "traceback": got}
        free[stage] = free_bytes()
        steps.put("next")
    results.get(timeout=60)
    child.join(30)
    readings["cuda_context_bytes"] = free["before"] - free["context"]
    readings["nccl_communicator_bytes_world_1"] = free["context"] - free["nccl"]
    estimates = {"cuda_context_bytes": preflight.CUDA_CONTEXT_BYTES,
                 "nccl_communicator_bytes_world_1": preflight.NCCL_COMMUNICATOR_BYTES}
    return {"status": "pass", "free": free, "measured": readings, "preflight_estimates": estimates,
            "ratio_measured_over_estimate": {k: readings[k] / estimates[k] for k in readings},
            "not_measured_here": {"ENGINE_ASLEEP_BYTES": "needs vLLM's sleep mode (no vLLM on the lent machine)",
                                  "CUDA_GRAPH_POOL_BYTES": "needs vLLM's graph capture (no vLLM on the lent machine)"}}


# ----------------------------------------------------------------------------------------- 8. memory_saver


def memory_saver_section(device: torch.device, tms: dict) -> dict:
    if device.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA"}
    if not tms["available"]:
        return {"status": "skipped", "reason": tms["reason"]}
    from colocate.errors import DeviceMemoryShortfall, MemorySaverError
    from colocate.host.memory import process_rss_bytes
    from colocate.trainer.memory_saver import MemorySaverOffload

    offloader = MemorySaverOffload(device, tag="gpu-check-guard", owner="gpu_check")
    with offloader.allocation_region():
        state = [torch.ones(256 << 20, dtype=torch.uint8, device=device)]  # 256 MiB
    refused = {}
    try:
        offloader.onload()
    except MemorySaverError as e:
        refused["resume_without_pause"] = str(e)
    rss = {"before_first_pause": process_rss_bytes()}
    offloader.offload(state)
    rss["after_first_pause"] = process_rss_bytes()
    try:
        offloader.offload(state)
    except MemorySaverError as e:
        refused["second_pause"] = str(e)
    real_free = offloader._free_bytes
    offloader._free_bytes = lambda: 1 << 20
    try:
        offloader.onload()
    except DeviceMemoryShortfall as e:
        refused["resume_that_cannot_fit"] = str(e)
    offloader._free_bytes = real_free
    offloader.onload()
    rss["after_resume"] = process_rss_bytes()
    offloader.offload(state)
    rss["after_second_pause"] = process_rss_bytes()
    offloader.onload()
    intact = bool((state[0] == 1).all())
    ok = len(refused) == 3 and intact
    return {"status": "pass" if ok else "fail", "refused": refused, "state_intact": intact, "rss": rss,
            "second_pause_host_growth_bytes": rss["after_second_pause"] - rss["after_first_pause"]}


# --------------------------------------------------------------------------------------------------- main


def _failure() -> dict:
    text = traceback.format_exc()
    return {"status": "fail", "error": text.strip().splitlines()[-1], "traceback": text[-6000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size-mib", type=int, default=256, help="ring slot size (and the race's slot)")
    parser.add_argument("--num-buckets", type=int, default=8, help="buckets sent through the 2-slot ring")
    parser.add_argument("--race-trials", type=int, default=5)
    parser.add_argument("--offload-gib", type=float, default=4.0, help="trainer state in the offload section")
    parser.add_argument("--tms-wheel", help="torch_memory_saver wheel to use when the package is not importable")
    parser.add_argument("--out", help="JSON path (default: $OUT/gpu_check.json, else benchmarks/results/gpu/)")
    args = parser.parse_args()
    default_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks/results/gpu"
    out_path = Path(args.out) if args.out else default_dir / f"gpu_check{'' if args.device == 'cuda' else '_cpu'}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    report = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "config": vars(args),
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
    started = time.perf_counter()
    tms = ensure_tms(args.tms_wheel) if device.type == "cuda" else {"available": False, "reason": "CPU mode"}
    sections = {"env": lambda: env_section(device, tms), "ring_ipc": lambda: ring_section(args, device),
                "late_load_race": lambda: race_section(args, device), "fsdp2_nccl": lambda: fsdp2_section(device, tms),
                "offload": lambda: offload_section(args, device, tms), "memory_release": lambda: memory_section(device),
                "constants": lambda: constants_section(device),
                "memory_saver": lambda: memory_saver_section(device, tms)}
    for key, run in sections.items():
        t0 = time.perf_counter()
        try:
            result = run()
        except Exception:
            result = _failure()
        result["seconds"] = time.perf_counter() - t0
        report["sections"][key] = result
        report["total_seconds"] = time.perf_counter() - started
        report["passed"] = all(s["status"] != "fail" for s in report["sections"].values())
        out_path.write_text(json.dumps(report, indent=2, default=str))
        print(f"[{key}] {result['status']} in {result['seconds']:.1f} s"
              + (f": {result.get('error') or result.get('reason')}" if result["status"] != "pass" else ""), flush=True)
    print(f"total {report['total_seconds']:.1f} s, {'passed' if report['passed'] else 'FAILED'}; wrote {out_path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
