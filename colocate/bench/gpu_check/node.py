"""The machine: versions and device (env), and colocate's node checks as they read it (node_checks).

node_checks runs what `colocate launch` / `validate` run on a CUDA node before any actor starts
(job/checks.py `check_devices`: host/node_checks.py `compute_modes`, `mps_pipe_directory`, `shm_free_bytes`,
`check_node`, and job/preflight.py `check_environment`), for a co-located and a split placement of the default
job, and records each reading beside what nvidia-smi says of the same GPUs, so a wrong refusal (defect 6 of the
third reading) shows as a disagreement. On the CPU the same calls run (NVML absent: no modes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def run_tool(*argv) -> str | None:
    """A tool's output, or None where it is missing or fails (the GPU machine's copy of the tree has no .git)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() if done.returncode == 0 else None
    return None


def ensure_tms(wheel: str | None) -> dict:
    """Make torch_memory_saver importable. The GPU machine has no registry, so the carried wheel is unzipped into
    a temporary directory put first on sys.path (children inherit it): no pip, no write to site-packages. The
    wheel keeps its hook libraries beside the package, where the package looks for them."""
    how = "already importable"
    try:
        if importlib.util.find_spec("torch_memory_saver") is None:
            if not wheel:
                return {"available": False, "reason": "not importable and no --tms-wheel given"}
            target = tempfile.mkdtemp(prefix="tms-")
            zipfile.ZipFile(wheel).extractall(target)
            sys.path.insert(0, target)
            importlib.invalidate_caches()
            how = f"unzipped {Path(wheel).name} onto sys.path"
        import torch_memory_saver  # noqa: F401
    except Exception as e:  # a missing or broken wheel is a result to record, not a reason to stop
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    with contextlib.suppress(Exception):
        how += f", version {importlib.metadata.version('torch_memory_saver')}"
    return {"available": True, "how": how}


def env_section(device: torch.device, tms: dict) -> dict:
    out = {"status": "pass", "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": socket.gethostname(), "cpu_count": os.cpu_count(),
           "torch_memory_saver": tms, "git": run_tool("git", "-C", str(ROOT), "rev-parse", "HEAD"),
           "git_status": run_tool("git", "-C", str(ROOT), "status", "--short")}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["transformers"] = importlib.metadata.version("transformers")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(device_name=props.name, total_memory=props.total_memory, uuid=str(props.uuid),
                   capability=f"{props.major}.{props.minor}", nccl=str(torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):  # a private binding: a missing one must not fail the section
            out["cuda_driver_api"] = torch._C._cuda_getDriverVersion()
        out["driver"] = run_tool("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0")
    return out


def _pipe_files() -> list[str]:
    """What lies in the MPS pipe directory (a stale file without a daemon must not be refused)."""
    directory = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return sorted(p.name for p in directory.glob("*")) if directory.is_dir() else []


def node_checks_section(device: torch.device) -> dict:
    from colocate.config import JobConfig
    from colocate.errors import ConfigError
    from colocate.host.node_checks import check_node, compute_modes, host_needs, mps_pipe_directory, shm_free_bytes
    from colocate.job.preflight import check_environment, host_available_bytes, model_dims

    modes = compute_modes()
    mps = mps_pipe_directory()
    readings = {"compute_modes": modes, "mps_pipe_directory": str(mps) if mps else None, "shm_free_bytes":
                shm_free_bytes(), "host_available_bytes": host_available_bytes(),
                "pynvml_importable": importlib.util.find_spec("pynvml") is not None,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "mps_pipe_files": _pipe_files(),
                "nvidia_smi_compute_mode": run_tool("nvidia-smi", "--query-gpu=index,compute_mode",
                                                    "--format=csv,noheader"),
                "nvidia_smi_gpus": run_tool("nvidia-smi", "-L")}
    base = JobConfig()
    placements = {"colocated": base,
                  "split": dataclasses.replace(base, placement=dataclasses.replace(base.placement, num_slots=2,
                                                                                   engine_slots=1))}
    verdicts = {}
    for name, cfg in placements.items():
        host = host_needs(cfg, model_dims(cfg), offload=True)
        try:
            check_node(cfg, host, available_host_bytes=readings["host_available_bytes"],
                       shm_bytes=readings["shm_free_bytes"], modes=modes, mps=mps)
            verdicts[name] = "accepted"
        except ConfigError as e:
            verdicts[name] = f"refused: {e}"
    try:
        check_environment(device.type)
        verdicts["environment"] = "accepted"
    except ConfigError as e:
        verdicts["environment"] = f"refused: {e}"
    return {"status": "pass", "device": device.type, "readings": readings, "verdicts": verdicts}
