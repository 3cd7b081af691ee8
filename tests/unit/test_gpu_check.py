"""scripts/gpu_check.py in its CPU mode: the ring protocol it runs on the lent GPU (an engine-worker process owning
the ring, two spawned trainer ranks casting into it, checksums, `load_regions`) runs here over shared memory, so
the script is known to work before a GPU machine is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
SECTIONS = {"env", "ring_ipc", "late_load_race", "fsdp2_nccl", "offload", "memory_release", "constants",
            "memory_saver"}


def test_cpu_mode_runs_the_ring_protocol_bit_exact(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--size-mib", "8", "--num-buckets", "6",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert {"command", "config", "started_at", "sections", "total_seconds", "passed"} <= report.keys()
    assert report["passed"] and set(report["sections"]) == SECTIONS
    assert all({"status", "seconds"} <= s.keys() for s in report["sections"].values())
    ring = report["sections"]["ring_ipc"]
    assert ring["status"] == "pass" and ring["bit_exact"] and ring["checksum_mismatches"] == 0
    assert ring["transport"] == "shm" and ring["num_buckets"] == 6 and ring["bytes"] == 6 * (8 << 20)
    assert ring["protocol_s"] > 0 and ring["floor_memcpy_s"] > 0 and ring["ratio"] > 0
    assert report["sections"]["late_load_race"]["status"] == "not_applicable"
    assert {report["sections"][k]["status"] for k in ("fsdp2_nccl", "offload", "memory_release", "constants",
                                                       "memory_saver")} == {"skipped"}
