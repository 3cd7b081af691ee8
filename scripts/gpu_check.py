"""One-GPU check of colocate's CUDA path, for a short loan of a GPU machine (torch and transformers only: no vLLM,
no Ray, colocate not installed); writes one JSON. The sections live in colocate/bench/gpu_check/.

    python3 scripts/gpu_check.py --tms-wheel wheels/torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl \
        --out $OUT/gpu_check.json                                       # one H200: about 3 minutes, at most 5
    .venv/bin/python scripts/gpu_check.py --device cpu --out /tmp/gpu_check_cpu.json   # the CPU twins, < 1 min

benchmarks/results/gpu/README.md has the exact device-tool call, and where results go. Sections (each one
function of the device; `--device cpu` runs every one the CPU has a path for, tests/unit/test_gpu_check.py in CI):

- env            versions, device, driver, UUID, whether torch_memory_saver is importable (and how)
- node_checks    host/node_checks.py's readings and verdicts for a co-located and a split job, beside nvidia-smi
- ring_ipc       the sync ring across processes (CUDA IPC / shared memory), bit-exact, against a memcpy
- late_load_race the slot-reuse hazard `load_regions` guards (CUDA only: CPU copies are synchronous)
- fsdp2          TrainerActor, world size 1 (NCCL / gloo): train steps, offload/onload bit-exact per backend, a
                 ring write of its shards
- offload        ~4 GiB of trainer state through each offload backend against a D2H/H2D floor; the offload
                 before the optimizer state exists
- memory_release freed memory back to the driver (empty_cache) or the OS (malloc_trim)
- constants      the preflight's per-process constants: CUDA context, NCCL communicator (CPU: process RSS, gloo)
- memory_saver   torch_memory_saver's guarded transitions (CUDA only; CPU twin: tests/unit/test_memory_saver.py)
- fresh_pages    what released-and-restored memory holds: torch_memory_saver without backup, the portable release
- steady_sync    the production gather writer and loader, warm-up apart: per-bucket cost and bandwidth fitted
                 over slot sizes, at the bench preset's size and two Qwen2.5-7B layers, against the cast floor
- train_step     Qwen2.5-7B's width cut to 4 layers at 4k-32k tokens: colocate's step against the preflight and a
                 plain PyTorch step, tokens/s, MFU, memory peaks (optimizer step apart), profiles with copy_ sources
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the GPU machine runs the bare working tree: colocate is not installed there
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network on the GPU machine: never try the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from colocate.bench.gpu_check.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
