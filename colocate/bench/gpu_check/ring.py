"""The sync ring across processes as in production, and the late-load race `load_regions` guards.

ring_ipc: this process is the engine worker (owns the ring: CUDA IPC on the GPU, POSIX shared memory on the CPU);
two trainer ranks, each a process of its own, attach it and cast fp32 rows into disjoint bf16 halves of each slot;
the worker checks their checksums and `load_regions` the slot, bucket after bucket. Parameters must equal the
fp32 sources cast to bf16, bit for bit. Its ratio (the whole protocol / one memcpy of the same bytes) counts the
per-bucket messages between processes, which the steady-state sync section (sync_steady.py) leaves out.

late_load_race: a load that returns before its copies ran, then the writer overwrites the slot. Two CUDA streams
stand for the two processes; a `_sleep` on the loader's stream makes the copy surely late. The unsynchronised
load must corrupt, `load_regions` never. On the CPU copies are synchronous: not applicable.
"""

from __future__ import annotations

import time
import traceback

import torch

from colocate.bench.gpu_check.common import context, copy_seconds, receive, sync
from colocate.sync.buckets import Region
from colocate.sync.load import load_regions, ring_view
from colocate.sync.buffers import attach, create_buffer, range_checksum

COLS = 4096  # columns of every test parameter (8 KiB bf16 rows)
NUM_TRAINERS = 2
SLEEP_CYCLES = 100_000_000  # ~50 ms of GPU spin at ~2 GHz: the late load surely runs after the overwrite


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
        results.put(("ready", (rank, None)))
        while (bucket := commands.get()) is not None:
            region = _regions(bucket, **{k: plan[k] for k in ("slot_bytes", "num_slots", "half")})[rank]
            start = time.perf_counter()
            ring_view(ring, region.offset, (region.num_rows, COLS), torch.bfloat16).copy_(sources[bucket])
            sync(ring.device)  # the worker reads the slot once told: the bytes must be there
            checksum = range_checksum(ring[region.offset:region.offset + region.num_bytes])
            results.put(("written", (rank, (bucket, checksum, time.perf_counter() - start))))
        del ring  # drop the mapping before the owner frees the ring
    except BaseException:
        results.put(("error", (rank, traceback.format_exc())))


def _next(results, procs, timeout: float):
    kind, (rank, payload) = receive(results, procs, timeout)
    if kind == "error":
        raise RuntimeError(f"trainer {rank} failed:\n{payload}")
    return kind, rank, payload


def ring_section(device: torch.device, *, size_mib: int, num_buckets: int) -> dict:
    slot_bytes, num_slots = size_mib << 20, 2
    half = slot_bytes // (COLS * 2) // NUM_TRAINERS
    assert half > 0, "--size-mib too small"
    plan = {"slot_bytes": slot_bytes, "num_slots": num_slots, "half": half, "num_buckets": num_buckets}
    owner = create_buffer(num_slots * slot_bytes, device=device, tag="gpucheck")
    ring = owner.tensor
    params = {f"bucket{b}": torch.zeros(half * NUM_TRAINERS, COLS, dtype=torch.bfloat16, device=device)
              for b in range(num_buckets)}
    ctx = context()
    results = ctx.Queue()
    commands = [ctx.Queue() for _ in range(NUM_TRAINERS)]
    # one handle per party, as each trainer rank gets its own (CUDA IPC counts the handles it exports)
    procs = [ctx.Process(target=_trainer, args=(r, owner.handle, plan, commands[r], results))
             for r in range(NUM_TRAINERS)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            assert _next(results, procs, 180)[0] == "ready"
        owner.unlink()  # every party has attached (a no-op for CUDA IPC)
        written: dict[int, dict[int, int]] = {b: {} for b in range(num_buckets)}
        write_s, load_s, mismatches, loaded = [], 0.0, 0, 0
        start = time.perf_counter()
        for b in range(min(num_slots, num_buckets)):
            for q in commands:
                q.put(b)
        while loaded < num_buckets:  # each trainer works in order, so buckets complete in order
            _, rank, (b, checksum, seconds) = _next(results, procs, 120)
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


def race_section(device: torch.device, *, size_mib: int, trials: int) -> dict:
    if device.type != "cuda":
        return {"status": "not_applicable", "reason": "not applicable on CPU: copies are synchronous"}
    rows = (size_mib << 20) // (COLS * 2)
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

    counts = {f"{'load_regions' if p else 'unsynchronised'}{'_sleep' if s else ''}": sum(
        corrupted(p, s) for _ in range(trials)) for p in (False, True) for s in (True, False)}
    protected_clean = counts["load_regions_sleep"] == 0 and counts["load_regions"] == 0
    hazard_shown = counts["unsynchronised_sleep"] > 0
    return {"status": "pass" if protected_clean and hazard_shown else "fail", "trials": trials,
            "corrupted": counts, "protected_clean": protected_clean, "hazard_shown": hazard_shown,
            "slot_bytes": ring.numel(), "sleep_cycles": SLEEP_CYCLES,
            "how": "one process, two streams standing for engine worker and trainer"}
