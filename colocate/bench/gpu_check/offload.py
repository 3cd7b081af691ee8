"""Trainer offload through `make_offloader` against a plain copy floor, memory handed back, and the
torch_memory_saver guards.

offload: ~4 GiB of trainer-like state (two embedding-sized tensors, 24 layer-sized, 100 small odd ones, AdamW's
CPU `step` scalar among them) through each backend, twice (the first round may allocate host buffers; the second
is the hot path): times against one D2H / H2D copy of the same bytes, memory freed, bit-exact. On the CPU the
same through the file tier, against a memcpy. Then `offload_before_optimizer_state`: the controller offloads
before the first step (the engine runs first), so the next offload meets the optimizer's new state
(tests/gpu/test_cuda_offload.py asserts the pinned buffer's reuse on its readings).

memory_release: freed memory handed back to the driver (`empty_cache`, cudaMemGetInfo) or to the OS
(`return_free_memory_to_os`, RSS).

memory_saver (CUDA only; its CPU twin is tests/unit/test_memory_saver.py, the package faked at its boundary): a
second pause, a resume without a pause and a resume that cannot fit are refused with named errors and the process
lives on; with retain_cpu_backup a second pause adds no host memory.
"""

from __future__ import annotations

import gc
import time

import torch

from colocate.bench.gpu_check.common import copy_seconds, failure, free_bytes, skipped
from colocate.host.memory import map_large_blocks, process_rss_bytes, return_free_memory_to_os
from colocate.host.storages import device_storages
from colocate.trainer.offload import host_layout, make_offloader

FREED_FRACTION = 0.95


def _state_numels(num_bytes: int) -> list[int]:
    """Mixed sizes like a trainer's state: two embedding-sized tensors, 24 layer-sized, 100 small odd ones."""
    n = num_bytes // 4
    numels = [n // 4] * 2 + [n // 64] * 24
    rest = (n - sum(numels)) // 100 - 7
    return numels + [rest + i % 7 for i in range(100)]


def _memory_reading(device: torch.device) -> int:
    """What an offload must raise (CUDA: the driver's free memory) or lower (CPU: this process's RSS)."""
    return free_bytes() if device.type == "cuda" else -process_rss_bytes()


def _device_bytes(tensors, device: torch.device) -> int:
    return sum(s.nbytes() for s in device_storages(tensors, device))


def offload_section(device: torch.device, tms: dict, *, state_bytes: int) -> dict:
    if device.type == "cpu":
        map_large_blocks()  # as a CPU trainer rank does (trainer/actor.py): its state's blocks are its own mappings
    numels = _state_numels(state_bytes)
    state_bytes = sum(numels) * 4
    dev_buf = torch.empty(state_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(state_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    floor = {"d2h_s": copy_seconds(host, dev_buf, device), "h2d_s": copy_seconds(dev_buf, host, device)}
    floor.update(d2h_gb_s=state_bytes / floor["d2h_s"] / 1e9, h2d_gb_s=state_bytes / floor["h2d_s"] / 1e9)
    del dev_buf, host
    _release(device)
    out = {"state_bytes": state_bytes, "num_tensors": len(numels) + 1, "floor": floor}
    backends = ["pinned", "torch_memory_saver"] if device.type == "cuda" else ["file"]
    for backend in backends:
        if backend == "torch_memory_saver" and not tms["available"]:
            out[backend] = skipped(tms["reason"])
            continue
        try:
            offloader = make_offloader(device, backend="auto" if backend == "file" else backend)
            assert offloader.name == backend, (offloader.name, backend)
            out[backend] = _measure_offloader(offloader, device, numels, floor)
            out[f"{backend}_before_optimizer_state"] = offload_before_optimizer_state(
                device, backend="auto" if backend == "file" else backend, size=1024)
        except Exception:
            out[backend] = failure()
        _release(device)
    statuses = [r["status"] for k, r in out.items() if isinstance(r, dict) and "status" in r]
    out["status"] = "fail" if "fail" in statuses else "pass"
    return out


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        return_free_memory_to_os()


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
            before = _memory_reading(device)
            t0 = time.perf_counter()
            moved = offloader.offload(tensors)
            if device.type == "cuda":
                torch.cuda.synchronize()
            offload_s = time.perf_counter() - t0
            freed = _memory_reading(device) - before
            t0 = time.perf_counter()
            back = offloader.onload()
            if device.type == "cuda":
                torch.cuda.synchronize()
            onload_s = time.perf_counter() - t0
            exact = all(torch.equal(t, e) for t, e in zip(tensors, expected))
            rounds.append({"offload_s": offload_s, "onload_s": onload_s, "freed_bytes": freed,
                           "offloaded_bytes": moved, "onloaded_bytes": back, "bit_exact": exact})
    finally:
        offloader.close()
    best = rounds[-1]
    ok = all(r["bit_exact"] and r["freed_bytes"] >= FREED_FRACTION * state_bytes
             and r["offloaded_bytes"] == r["onloaded_bytes"] >= state_bytes for r in rounds)
    return {"status": "pass" if ok else "fail", "rounds": rounds, "freed_fraction": best["freed_bytes"] / state_bytes,
            "offload_ratio": best["offload_s"] / floor["d2h_s"], "onload_ratio": best["onload_s"] / floor["h2d_s"]}


def _adam_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, size: int) -> None:
    device = next(model.parameters()).device
    model(torch.randn(8, size, device=device)).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def trainer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """As the trainer lists it: parameters, then every optimizer state tensor (the CPU `step` scalars included)."""
    return list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def create_optimizer_state(offloader, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state created the trainer's own way (trainer/offload.py `create_optimizer_state`, which
    TrainerActor calls: by hand, inside the offloader's region, so that no step's temporaries come from
    torch_memory_saver's pool)."""
    from colocate.trainer.offload import create_optimizer_state as trainers_way

    trainers_way(offloader, optimizer)


def offload_before_optimizer_state(device: torch.device, *, backend: str, size: int) -> dict:
    """The controller's order: offload the parameters before any step (no optimizer state yet), onload, create
    AdamW's state the trainer's way and step, then offload all of it twice. Expected bytes are read before each
    offload (an offload empties the storages it moves: the first GPU run's `67,125,248 == 0`). Readings for
    tests/gpu/test_cuda_offload.py, which asserts each backend's own facts (the pinned buffer's exact size and
    reuse, torch_memory_saver's kept addresses); `status` judges what holds for every backend."""
    torch.manual_seed(0)
    offloader = make_offloader(device, backend=backend)
    device = getattr(offloader, "device", device)  # the offloader's "cuda:N", as its storages report it
    with offloader.allocation_region():  # the trainer shards its parameters in the region (trainer/fsdp.py)
        model = torch.nn.Linear(size, size, device=device)
    optimizer = torch.optim.AdamW(model.parameters())
    out = {"offloader": offloader.name, "rounds": []}
    try:
        params = trainer_state(model, optimizer)
        out["params_bytes"] = _device_bytes(params, device)
        out["params_layout_total"] = host_layout(params, device).total
        out["params_offloaded"] = offloader.offload(params)
        out["params_host_numel"] = _host_numel(offloader)
        out["params_onloaded"] = offloader.onload()

        create_optimizer_state(offloader, optimizer)  # as train_step does before its first optimizer step
        _adam_step(model, optimizer, size)
        tensors = trainer_state(model, optimizer)
        out["state_bytes"] = _device_bytes(tensors, device)
        out["state_layout_total"] = host_layout(tensors, device).total
        expected = [t.detach().clone() for t in tensors]
        pointers = [t.data_ptr() for t in tensors]
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # only what the offload itself frees counts
            before = _memory_reading(device)
            moved = offloader.offload(tensors)
            freed = _memory_reading(device) - before
            host_numel, host_ptr = _host_numel(offloader), _host_ptr(offloader)
            back = offloader.onload()
            exact = all(torch.equal(t, e) for t, e in zip(tensors, expected))
            out["rounds"].append({"offloaded": moved, "onloaded": back, "freed": freed, "host_numel": host_numel,
                                  "host_ptr": host_ptr, "bit_exact": exact,
                                  "same_addresses": [t.data_ptr() for t in tensors] == pointers})
        _adam_step(model, optimizer, size)  # the module still trains
        out["trains_after"] = not torch.equal(model.weight, expected[0])
    finally:
        offloader.close()
    ok = out["params_offloaded"] == out["params_onloaded"] >= out["params_bytes"] > 0 and out["trains_after"] \
        and all(r["bit_exact"] and r["offloaded"] == r["onloaded"] >= out["state_bytes"] for r in out["rounds"])
    out["status"] = "pass" if ok else "fail"
    return out


def _host_numel(offloader) -> int | None:
    host = getattr(offloader, "_host", None)  # the pinned backend's one exact-size buffer
    return None if host is None else host.numel()


def _host_ptr(offloader) -> int | None:
    host = getattr(offloader, "_host", None)
    return None if host is None else host.data_ptr()


def memory_section(device: torch.device, *, size: int) -> dict:
    """A block allocated, written, freed: what comes back to the driver (CUDA) or the OS (CPU), and when."""
    _release(device)
    reading = {"before": _memory_reading(device)}
    block = torch.empty(size, dtype=torch.uint8, device=device)
    block.fill_(1)
    reading["allocated"] = _memory_reading(device)
    del block
    reading["after_del"] = _memory_reading(device)
    _release(device)
    reading["after_release"] = _memory_reading(device)
    taken = reading["before"] - reading["allocated"]
    returned = reading["after_release"] - reading["allocated"]
    ok = taken >= 0.99 * size and returned >= 0.99 * size
    return {"status": "pass" if ok else "fail", "bytes": size, "counter": "driver free" if device.type == "cuda"
            else "minus RSS", "reading": reading, "held_after_del": reading["before"] - reading["after_del"],
            "returned_by_release": returned,
            "release": "torch.cuda.empty_cache" if device.type == "cuda" else "return_free_memory_to_os"}


def memory_saver_section(device: torch.device, tms: dict) -> dict:
    if device.type != "cuda":
        return skipped("CUDA only: torch_memory_saver's guards run on the CPU in tests/unit/test_memory_saver.py")
    if not tms["available"]:
        return skipped(tms["reason"])
    from colocate.errors import DeviceMemoryShortfall, MemorySaverError
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
