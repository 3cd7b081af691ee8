"""Which device a process computes on, how it names it to others, how full it is, and how fast it copies.

Device *indices* mean nothing across processes: Ray gives each trainer actor `CUDA_VISIBLE_DEVICES=<its GPU>`
(index 0 in that process), while vLLM's Ray workers see every GPU and pick one by index. Processes therefore
name a GPU by its UUID, and the runtime pairs each trainer rank with the engine worker on the same GPU by
comparing those names (placement.pair_devices). On the CPU a device is a logical slot, named by its index.

    device = local_cuda_device()                  # trainer actor: the GPU Ray assigned to it
    name = device_name(device, slot=3)            # "GPU-6f0c..." on CUDA, "cpu-slot3" on the CPU
    device_memory(device)                         # {"device_allocated_bytes": ..., "device_free_bytes": ...}
    copy_seconds(destination, source)             # median time of one copy: the floor benchmarks divide by
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch


def local_cuda_device() -> torch.device:
    """The GPU Ray assigned to this actor, as an index among the GPUs this process sees. Ray narrows
    CUDA_VISIBLE_DEVICES to the assigned GPU for an actor with a GPU share, so this is usually cuda:0; it is
    looked up rather than assumed, for processes that see more (an actor started with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, as vLLM's workers are)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    assigned = _ray_gpu_ids()
    if assigned and not visible:  # every GPU visible (Ray told not to narrow it): indices are physical ids
        return torch.device("cuda", int(assigned[0]))
    if assigned and len(visible) > 1:
        assert assigned[0] in visible, f"Ray assigned GPU {assigned[0]}, not among CUDA_VISIBLE_DEVICES={visible}"
        return torch.device("cuda", visible.index(assigned[0]))
    return torch.device("cuda", 0)


def _ray_gpu_ids() -> list[str]:
    try:
        import ray

        if not ray.is_initialized():
            return []
        return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except Exception:  # outside a Ray worker (tests, scripts): nothing assigned
        return []


def device_name(device: torch.device, *, slot: int | None = None) -> str:
    """A name for the device that means the same in every process: the GPU's UUID, or the CPU slot."""
    if device.type == "cuda":
        return f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    assert slot is not None, "a CPU device is named by its slot"
    return f"cpu-slot{slot}"


def device_memory(device: torch.device) -> dict[str, int]:
    """This process's view of the device's memory: what torch allocated and reserved (its caching allocator),
    and what the driver says is free on the whole GPU (every process on it, vLLM's cuMem pool included).
    Empty on the CPU, where process RSS is the measure."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"device_allocated_bytes": torch.cuda.memory_allocated(device),
            "device_reserved_bytes": torch.cuda.memory_reserved(device),
            "device_free_bytes": free, "device_total_bytes": total}


def copy_seconds(destination: torch.Tensor, source: torch.Tensor, *, repeats: int = 5) -> float:
    """Median seconds of `destination.copy_(source)` (a cast when the dtypes differ), device work included."""
    destination.copy_(source)  # fault the pages in: the floor is the copy, not the first touch
    times = []
    for _ in range(repeats):
        if destination.is_cuda:
            torch.cuda.synchronize(destination.device)
        started = time.perf_counter()
        destination.copy_(source)
        if destination.is_cuda:
            torch.cuda.synchronize(destination.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# The CPU instructions that compute bf16 natively (Linux /proc/cpuinfo flag names): AVX-512 BF16's dot products
# and AMX's tile multiplies, which oneDNN (torch's CPU matmul for bf16) uses when present. Without them torch
# still computes bf16, by converting to fp32 and back: slower than fp32 itself.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_features() -> list[str]:
    """This CPU's native bf16 instruction sets among BF16_FLAGS; empty: none (bf16 would be emulated)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [flag for flag in BF16_FLAGS if flag in flags]
