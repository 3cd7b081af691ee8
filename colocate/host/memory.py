"""Memory measurement shared by the engine and trainer sides: process RSS, read without extra dependencies."""

from __future__ import annotations

import functools
import os

from colocate.host.procfs import process_tree


def process_rss_bytes(pid: int | str = "self", *, shared_memory: bool = True) -> int:
    """Resident set size of a process (default: this one), in bytes. `shared_memory=False` leaves out its
    resident shared-memory pages (RssShmem): a trainer rank maps the engine workers' weight arenas and rings,
    and those bytes belong to the engine, which counts them once."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssShmem:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"] - (0 if shared_memory else fields.get("RssShmem", 0))


PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def advise_huge_pages(address: int, num_bytes: int) -> None:
    """Ask for transparent huge pages on [address, address + num_bytes) before it is first written: the kernel
    then faults it in 2 MiB at a time (this machine's THP mode is `madvise`: nothing without the advice).
    Best effort: a kernel without THP, or a range under 2 MiB, is left as it is."""
    start = (address + PAGE - 1) // PAGE * PAGE
    end = (address + num_bytes) // PAGE * PAGE
    libc = _libc()
    if libc is None or end - start < HUGE_PAGE:
        return
    import ctypes

    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


M_MMAP_THRESHOLD = -3  # glibc malloc.h
LARGE_BLOCK_BYTES = 1 << 20


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> None:
    """Give every host allocation of at least `threshold` bytes its own mapping, unmapped when it is freed
    (glibc `mallopt(M_MMAP_THRESHOLD)`, which also switches the dynamic threshold off).

    Why, for a CPU trainer: by default glibc raises its threshold each time a large mmapped block is freed (up to
    32 MiB), so a train step's activations soon come from the heap. A block freed below a live one stays resident,
    and the step's peak RSS grows by what the backward has already freed: measured on the bench preset (8 layers,
    one 4,160-token sequence, fwd+bwd), 3.1 GiB instead of 2.4 with every activation kept, 1.1 GiB instead of 0.5
    with checkpointing, whose recompute frees and reallocates a layer's activations once per layer. With it the
    peak is what the live tensors need, which is what the preflight predicts. Cost: the kernel zero-fills each
    new mapping; 2-10% of a step on that bench, less at 1 MiB than at 64 KiB. glibc only; elsewhere nothing."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, threshold)


def return_free_memory_to_os() -> None:
    """Hand the allocator's free memory back to the OS (glibc `malloc_trim`).

    Hazard: glibc raises its mmap threshold each time a large mmapped block is freed, so after a few
    release/restore cycles big tensors come from the heap, and freeing them only returns them to malloc's free
    lists: RSS would not drop when the engine sleeps or the trainer offloads. Trimming after a release fixes that.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


def tree_pss_bytes(root: int) -> dict[str, int]:
    """Memory of a whole process tree by process name (`/proc/PID/comm`, e.g. ray::TrainerAct), each page
    counted once: proportional set sizes (a page shared by n processes counts 1/n in each). Summing RSS instead
    would count a weight arena, a ring or a shared library once per process mapping it."""
    by_name: dict[str, int] = {}
    for pid in [e["pid"] for e in process_tree(root)]:
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        by_name[name] = by_name.get(name, 0) + int(line.split()[1]) * 1024
                        break
        except OSError:  # exited, or not ours to read
            continue
    return by_name
