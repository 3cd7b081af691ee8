"""What a GPU node must provide beyond its GPUs' memory, checked on the node before any actor starts.

    host = host_needs(cfg, dims, offload=True)   # {"checkpoint in fp32, every rank": ..., ...}
    check_node(cfg, host)                        # ConfigError naming the first requirement the node misses

- **Compute mode Default, no MPS.** A trainer rank and an engine worker share each GPU, in two processes:
  "Exclusive Process" mode refuses the second process's context, and under MPS the processes share one
  context server, which CUDA IPC between them does not support (the sync ring is a CUDA IPC handle) and which
  caps each client's memory. Read with NVML (`pynvml`, which vLLM's CUDA build depends on) where it imports.
- **/dev/shm.** NCCL's intra-node transport and vLLM's message queues live in /dev/shm; Docker's default
  64 MiB breaks NCCL at its first collective. Run containers with `--ipc=host` or `--shm-size=16g`.
- **Host memory at start-up.** Every rank loads the whole checkpoint in fp32 on the host before it moves and
  shards it (trainer/actor.py setup), so a node with N ranks briefly holds N x 4 bytes per parameter; a trainer
  that offloads (`trainer.offload`) keeps its state's host copy (12 bytes per parameter, over the node's ranks)
  from then on. The two never coexist (the checkpoint copies are freed once sharded): the larger must fit.
On the CPU the job's host memory is the preflight's budget already, and /dev/shm holds the sync's segments,
sized by the same prediction; only the GPU node's requirements are checked here.
"""

from __future__ import annotations

import os
from pathlib import Path

from colocate.config import JobConfig
from colocate.errors import ConfigError

GIB = 1 << 30
MIN_SHM_BYTES = 1 * GIB  # NCCL's shared-memory transport and vLLM's queues, with room
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # the MPS control daemon's default (CUDA_MPS_PIPE_DIRECTORY overrides it)


def host_needs(cfg: JobConfig, dims, *, offload: bool) -> dict[str, int]:
    """Host bytes of a one-node CUDA job: at start-up, and what offloading keeps there."""
    num_ranks = cfg.placement.num_trainer_ranks
    needs = {"checkpoint loaded in fp32 by every rank (start-up)": num_ranks * 4 * dims.num_params}
    if offload:
        needs["trainer state's host copy (offload)"] = 12 * dims.num_params
    return needs


def shm_free_bytes(path: str = "/dev/shm") -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def compute_modes() -> list[str] | None:
    """Each GPU's compute mode as NVML names it, or None where NVML cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML (no driver, no package): nothing to read, nothing to refuse
        return None
    try:
        names = {pynvml.NVML_COMPUTEMODE_DEFAULT: "Default", pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                 "Exclusive_Process", pynvml.NVML_COMPUTEMODE_PROHIBITED: "Prohibited"}
        return [names.get(pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByIndex(i)), "unknown")
                for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()


def mps_pipe_directory() -> Path | None:
    """The MPS control daemon's pipe directory when a daemon is there (its `control` pipe exists), else None."""
    directory = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIRECTORY))
    return directory if (directory / "control").exists() else None


def check_node(cfg: JobConfig, host: dict[str, int], *, available_host_bytes: int, shm_bytes: int,
               modes: list[str] | None, mps: Path | None) -> None:
    """Raise ConfigError for the first requirement this GPU node misses (each reading passed in: pure)."""
    if modes is not None and (bad := [f"GPU {i}: {m}" for i, m in enumerate(modes) if m != "Default"]):
        raise ConfigError(f"GPU compute mode {', '.join(bad)}: a trainer rank and an engine worker share each GPU "
                          "in two processes, which needs mode Default (nvidia-smi -c DEFAULT)")
    if mps is not None:
        raise ConfigError(f"an MPS control daemon runs ({mps}/control): CUDA IPC between the trainer and the "
                          "engine on a GPU does not work under MPS; stop it (echo quit | nvidia-cuda-mps-control)")
    if shm_bytes < MIN_SHM_BYTES:
        raise ConfigError(f"/dev/shm has {shm_bytes / GIB:.2f} GiB free, under the {MIN_SHM_BYTES / GIB:.0f} GiB "
                          "NCCL and vLLM need: run the container with --ipc=host or --shm-size=16g")
    largest = max(host, key=host.get)
    if host[largest] > available_host_bytes:
        raise ConfigError(
            f"host memory: the job needs {host[largest] / GIB:.1f} GiB on this node ({largest}) but "
            f"{available_host_bytes / GIB:.1f} GiB is available; use fewer ranks per node (placement.num_slots, "
            f"now {cfg.placement.num_slots}) or a node with more memory")
