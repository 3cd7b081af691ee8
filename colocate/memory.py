"""Memory measurement shared by the engine and trainer sides: process RSS, read without extra dependencies."""

from __future__ import annotations

import os


def process_rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (default: this one), in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
