"""What memory holds when it comes back without its contents (defect 3 of the third reading): after vLLM's
level-2 sleep, vLLM restores parameters and named buffers only, and the buffers the sync never writes (a LoRA
adapter's untargeted modules, A rows past the adapter's rank, expert LoRA buffers) hold whatever the fresh pages
hold. The lent GPU machine has no vLLM, so this reads what the same mechanism hands back.

- CUDA, torch_memory_saver without a host backup (`enable_cpu_backup=False`: its pause unmaps and its resume maps
  new physical memory at the same virtual address, csrc/core.cpp `resume`: cuMemCreate + cuMemMap, no copy), the
  mechanism vLLM's cuMem allocator shares (vllm/device_allocator/cumem.py: `sleep` unmaps and releases the
  handles of a tag without backup, `wake_up` creates and maps new ones). Between pause and resume this process
  fills and frees as much memory again with a marker, so recycled physical pages would show it.
- Both devices, the portable release (engine/sleep.py `PortableSleep`, level 2): storages resized to 0 and back
  (engine/sleep.py's hazard: "the KV cache comes back with garbage"); a restored storage comes from the
  allocator: fresh pages from the OS (zero) for large blocks on the CPU, torch's cache on CUDA, which may hand
  back the very block it held.
Each buffer is filled with a pattern first; after coming back each byte is read as kept (the pattern), zero, the
marker, or other. The section records what it found; it fails only when the machinery itself fails.
"""

from __future__ import annotations

import torch

from colocate.bench.gpu_check.common import failure, skipped, sync

PATTERN, MARKER = 0x5A, 0xC3


def _census(buffer: torch.Tensor) -> dict:
    """Fractions of the buffer's bytes that are the pattern, zero, the marker, or anything else."""
    data = buffer.view(torch.uint8).flatten()
    total = data.numel()
    counts = {"kept": int((data == PATTERN).sum()), "zero": int((data == 0).sum()),
              "marker": int((data == MARKER).sum())}
    counts["other"] = total - sum(counts.values())
    return {**{k: v / total for k, v in counts.items()}, "bytes": total}


def _churn(device: torch.device, num_bytes: int) -> None:
    """Fill and free `num_bytes` with the marker: pages handed back now and reused later would carry it."""
    block = torch.full((num_bytes,), MARKER, dtype=torch.uint8, device=device)
    sync(device)
    del block
    if device.type == "cuda":
        torch.cuda.empty_cache()


def portable_sleep_pages(device: torch.device, *, num_bytes: int) -> dict:
    """A one-buffer 'model' (the buffer as a parameter, as an adapter buffer is one) slept at level 2 and its
    weights woken, with no sync writing it."""
    from colocate.engine.sleep import WEIGHTS, PortableSleep

    module = torch.nn.Module()
    module.buffer = torch.nn.Parameter(torch.full((num_bytes,), PATTERN, dtype=torch.uint8, device=device),
                                       requires_grad=False)
    sleeper = PortableSleep(module, kv_caches=[])
    released = sleeper.sleep(level=2)
    _churn(device, num_bytes)
    restored = sleeper.wake([WEIGHTS])
    sync(device)
    return {"released_bytes": released, "restored_bytes": restored, **_census(module.buffer.detach())}


def memory_saver_pages(device: torch.device, *, num_bytes: int) -> dict:
    """A buffer in a torch_memory_saver region without a host backup, paused and resumed."""
    from torch_memory_saver import torch_memory_saver as saver

    try:
        saver.hook_mode = "torch"  # trainer/memory_saver.py: settable before the singleton's first use only
    except AttributeError:
        pass
    tag = "gpu-check-fresh-pages"
    with torch.cuda.device(device), saver.region(tag=tag, enable_cpu_backup=False):
        buffer = torch.full((num_bytes,), PATTERN, dtype=torch.uint8, device=device)
    pointer = buffer.data_ptr()
    torch.cuda.synchronize(device)
    saver.pause(tag)
    _churn(device, num_bytes)
    saver.resume(tag)
    torch.cuda.synchronize(device)
    return {"same_address": buffer.data_ptr() == pointer, **_census(buffer)}


def fresh_pages_section(device: torch.device, tms: dict, *, num_bytes: int) -> dict:
    out = {"pattern": PATTERN, "marker": MARKER}
    try:
        out["portable_sleep"] = portable_sleep_pages(device, num_bytes=num_bytes)
    except Exception:
        out["portable_sleep"] = failure()
    if device.type != "cuda":
        out["torch_memory_saver"] = skipped("CUDA only (the CPU has no torch_memory_saver)")
    elif not tms["available"]:
        out["torch_memory_saver"] = skipped(tms["reason"])
    else:
        try:
            out["torch_memory_saver"] = memory_saver_pages(device, num_bytes=num_bytes)
        except Exception:
            out["torch_memory_saver"] = failure()
    out["status"] = "fail" if any(out[k].get("status") == "fail" for k in ("portable_sleep", "torch_memory_saver")) \
        else "pass"
    return out
