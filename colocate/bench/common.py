"""What every benchmark result carries: the floor measured in the same run, versions, machine, command."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from colocate.host.devices import copy_seconds

# The bench preset on the CPU: 24 layers, >= 0.4 GB of bf16 weights, engine TP=2 (see colocate.models.sources). The
# switch is what the switch benchmark measures: both sides move, whatever the preflight would choose.
BENCH_DEFAULTS = ["model.preset=bench", "engine.kv_cache_gib=0.25", "engine.max_model_len=128",
                  "logging.progress=false", "engine.sleep_level=2", "trainer.offload=true"]
# `colocate bench consistency`: one engine worker and one trainer rank, the path where equal bits could be had
CONSISTENCY_DEFAULTS = [*BENCH_DEFAULTS, "engine.tp=1", "placement.num_slots=1"]


def memcpy_floor_s(num_bytes: int, *, device: str = "cpu", repeats: int = 5) -> float:
    """Median time of one single-process copy of `num_bytes` (the physical floor of moving those bytes once)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    return copy_seconds(torch.empty_like(src), src, repeats=repeats)


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": len(times)}


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("vllm", "ray", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # an optional component missing is recorded, not fatal
            out[name] = None
    try:
        root = Path(__file__).resolve().parents[2]
        out["colocate_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                                                capture_output=True, text=True).stdout.strip() or None
    except OSError:
        out["colocate_commit"] = None
    return out


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "memory_gib": round(mem / 2**30, 1),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_result(result: dict, out_dir: str, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(["colocate", *sys.argv[1:]]) if sys.argv else "", "versions": versions(),
              "machine": machine(), **result}
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path
