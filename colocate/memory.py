"""Memory measurement shared by the engine and trainer sides: process RSS, read without extra dependencies."""

from __future__ import annotations

import os


def process_rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (default: this one), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def return_free_memory_to_os() -> None:
    """Hand the allocator's free memory back to the OS (glibc `malloc_trim`).

    Hazard: glibc raises its mmap threshold each time a large mmapped block is freed, so after a few
    release/restore cycles big tensors come from the heap, and freeing them only returns them to malloc's free
    lists: RSS would not drop when the engine sleeps or the trainer offloads. Trimming after a release fixes that.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):  # glibc only
            libc.malloc_trim(0)
