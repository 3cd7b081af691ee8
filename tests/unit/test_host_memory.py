"""host/memory.py map_large_blocks: a freed large block goes back to the OS even below a live one."""

from __future__ import annotations

import subprocess
import sys

FRAGMENT = """
import sys, torch
from colocate.host.memory import map_large_blocks, process_rss_bytes
if sys.argv[1] == "mapped":
    map_large_blocks()
torch.ones(4 << 20)  # 16 MiB, mmapped and freed: glibc's dynamic threshold rises past 8 MiB
a = torch.ones(2 << 20)  # 8 MiB: from the heap, unless large blocks are mapped
b = torch.ones(1 << 10)  # a small live block above it
before = process_rss_bytes()
del a
print((before - process_rss_bytes()) >> 20)
"""


def _mib_returned(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_a_freed_block_below_a_live_one_leaves_rss_only_when_large_blocks_are_mapped():
    assert _mib_returned("heap") == 0  # glibc's default: it stays resident, the step's peak RSS grows by it
    assert _mib_returned("mapped") == 8
