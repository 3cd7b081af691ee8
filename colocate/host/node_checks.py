"""What a GPU node must provide beyond its GPUs' memory, checked on the node before any actor starts.

    host = host_needs(cfg, dims, offload=True)   # {"checkpoint in fp32, every rank": ..., ...}
    check_node(cfg, host, modes=compute_modes(), mps=mps_pipe_directory(), ...)  # ConfigError: the first miss

- **Compute mode, per placement.** A GPU in mode "Prohibited" takes no context at all: always refused. "Exclusive
  Process" takes one process's context and refuses the second's: refused only where the job puts two of its
  processes on one GPU (co-located: a trainer rank and an engine worker on every GPU; split: a reward model
  beside the engines' workers). A split placement without a reward model runs one process per GPU, which
  exclusive mode allows. Read with NVML (`pynvml`, which vLLM's CUDA build depends on) where it imports, for the
  GPUs the job's processes can see only (CUDA_VISIBLE_DEVICES, by index or by UUID: visible_gpus).
- **No live MPS daemon**, for any placement. Under MPS the processes of a GPU share one context server, which
  CUDA IPC between them does not support (the co-located sync ring is a CUDA IPC handle); no GPU path of
  colocate is checked under MPS.
  CUDA joins MPS only when it can connect to the control daemon's pipe, and runs without it otherwise (NVIDIA's
  nvidia-cuda-mps-control(1)): a pipe file that a stopped daemon left behind changes nothing, so the check is
  that connection (mps_daemon_listens), not the file.
- **/dev/shm.** NCCL's intra-node transport and vLLM's message queues live in /dev/shm; Docker's default
  64 MiB breaks NCCL at its first collective. Run containers with `--ipc=host` or `--shm-size=16g`.
- **Host memory at start-up.** Every rank loads the whole checkpoint in fp32 on the host before it moves and
  shards it (trainer/actor.py setup), so a node with N ranks briefly holds N x 4 bytes per parameter; a trainer
  that offloads (`trainer.offload`) keeps its state's host copy (12 bytes per parameter, over the node's ranks,
  a critic's with it) from then on, and sync.delta's weight stores are held from the first sync on. The
  start-up copies never coexist with those (they are freed once sharded): the larger must fit.
On the CPU the job's host memory is the preflight's budget already, and /dev/shm holds the sync's segments,
sized by the same prediction; only the GPU node's requirements are checked here.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from colocate.config import JobConfig
from colocate.config.reward_model import reward_models_in
from colocate.errors import ConfigError

GIB = 1 << 30
MIN_SHM_BYTES = 1 * GIB  # NCCL's shared-memory transport and vLLM's queues, with room
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # the MPS control daemon's default (CUDA_MPS_PIPE_DIRECTORY overrides it)
# NVML's compute modes (nvml.h nvmlComputeMode_t; 1, Exclusive_Thread, is deprecated and acts as 3 does)
MODE_NAMES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}


def host_needs(cfg: JobConfig, dims, *, offload: bool, critic_params: int = 0,
               delta_store_bytes: int = 0) -> dict[str, int]:
    """Host bytes of a one-node CUDA job: at start-up, and what offloading keeps there (`critic_params`: the
    critic's, algo.advantage=gae, offloaded with the policy's state), and sync.delta's weight stores (always)."""
    num_ranks = cfg.placement.num_trainer_ranks
    needs = {"checkpoint loaded in fp32 by every rank (start-up)": num_ranks * 4 * dims.num_params}
    # after start-up, held together: the offloaded state's host copy (the critic's with the policy's) and the
    # delta sync's weight stores
    steady = {}
    if offload:
        steady["trainer state's host copy (offload)"] = 12 * (dims.num_params + critic_params)
    if delta_store_bytes:
        steady["delta weight stores (sync.delta)"] = delta_store_bytes
    if len(steady) == 1:
        needs.update(steady)
    elif steady:
        needs[" + ".join(steady)] = sum(steady.values())
    return needs


def shm_free_bytes(path: str = "/dev/shm") -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def visible_gpus(value: str | None, uuids: list[str], mig_parents: dict[str, int] | None = None) -> list[int]:
    """The NVML indices of the GPUs a CUDA process sees under CUDA_VISIBLE_DEVICES=`value` (None: unset, every
    GPU), in CUDA's order. `uuids`: each GPU's UUID by NVML index; `mig_parents`: each MIG device's UUID -> its
    GPU's index. CUDA's rules (CUDA C++ Programming Guide, "CUDA Environment Variables"): entries are indices or
    UUIDs ("GPU-8932f937-..." or any prefix naming one GPU alone), MIG devices "MIG-<uuid>" or
    "MIG-GPU-<uuid>/<GI>/<CI>"; the list ends at the first entry naming no GPU ("0,2,-1,1" shows 0 and 2).
    Hazard: an index is CUDA's, which orders the fastest GPU first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and NVML
    orders by PCI bus; on a node of one GPU model the two agree (vLLM maps indices the same way,
    platforms/interface.py device_id_to_physical_device_id)."""
    if value is None:
        return list(range(len(uuids)))
    seen: list[int] = []
    for entry in (e.strip() for e in value.split(",")):
        gpu = _gpu_named(entry, uuids, mig_parents or {})
        if gpu is None:
            break
        if gpu not in seen:  # a GPU's MIG devices count once: the mode is the GPU's
            seen.append(gpu)
    return seen


def _gpu_named(entry: str, uuids: list[str], mig_parents: dict[str, int]) -> int | None:
    if entry.isdigit():
        return int(entry) if int(entry) < len(uuids) else None
    if entry.startswith("MIG-GPU-"):  # the pre-R470 form: the GPU's own UUID, then instance ids
        return _gpu_named(entry[len("MIG-"):].split("/")[0], uuids, {})
    if entry.startswith("MIG-"):
        return mig_parents.get(entry)
    if entry.startswith("GPU-"):
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None


def compute_modes() -> dict[int, str] | None:
    """The compute mode of each GPU this process's CUDA can see (NVML index -> NVML's name), or None where NVML
    cannot be read."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVML (no driver, no package): nothing to read, nothing to refuse
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        visible = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids, _mig_parents(pynvml, handles))
        return {i: MODE_NAMES.get(pynvml.nvmlDeviceGetComputeMode(handles[i]), "unknown") for i in visible}
    finally:
        pynvml.nvmlShutdown()


def _mig_parents(pynvml, handles: list) -> dict[str, int]:
    """Each MIG device's UUID -> its GPU's index (empty for GPUs without MIG, or where NVML cannot say)."""
    parents = {}
    for index, handle in enumerate(handles):
        try:
            for m in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    parents[_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, m)))] \
                        = index
                except pynvml.NVMLError:  # an empty slot of the GPU's MIG devices
                    continue
        except pynvml.NVMLError:  # not MIG-capable
            continue
    return parents


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml returns bytes


def mps_daemon_listens(control: Path) -> bool:
    """Whether an MPS control daemon answers at its pipe `control`, as CUDA would find it. The daemon talks over
    named pipes and UNIX domain sockets (NVIDIA's MPS guide, CUDA_MPS_PIPE_DIRECTORY): a socket is live when a
    connect succeeds, a FIFO when it has a reader (opening it to write without blocking fails with ENXIO when
    none does). A stale socket refuses, a stale FIFO has no reader, a plain file is neither; none of them is a
    daemon CUDA would join, nor is one this process may not open (CUDA's clients run as this user)."""
    try:
        mode = control.stat().st_mode
    except OSError:
        return False
    if stat.S_ISSOCK(mode):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            try:
                sock.connect(str(control))
            except OSError:  # ECONNREFUSED: nobody listens; EACCES: nor could CUDA connect
                return False
            return True
    if stat.S_ISFIFO(mode):
        try:
            os.close(os.open(control, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # ENXIO: no reader; EACCES: nor could CUDA open it
            return False
        return True
    return False


def mps_pipe_directory() -> Path | None:
    """The MPS control daemon's pipe directory when a live daemon answers there, else None."""
    directory = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIRECTORY))
    return directory if mps_daemon_listens(directory / "control") else None


def processes_sharing_a_gpu(cfg: JobConfig) -> str | None:
    """Why two of the job's processes share a GPU (their contexts must coexist), or None where none does."""
    if not cfg.placement.engine_slots:
        return "a trainer rank and an engine worker share each GPU in two processes (co-located placement)"
    if reward_models_in(cfg.rollout.rewards):
        return "the reward model's workers share the first engine GPUs with the policy's, in processes of their own"
    return None


def check_node(cfg: JobConfig, host: dict[str, int], *, available_host_bytes: int, shm_bytes: int,
               modes: dict[int, str] | None, mps: Path | None) -> None:
    """Raise ConfigError for the first requirement this GPU node misses (each reading passed in: pure). `modes`:
    the compute mode of each GPU the job can see, by NVML index (compute_modes); `mps`: a live MPS daemon's pipe
    directory (mps_pipe_directory)."""
    modes = modes or {}
    if prohibited := [i for i, m in modes.items() if m == "Prohibited"]:
        raise ConfigError(f"GPU compute mode GPU {prohibited[0]}: Prohibited: no process can use it; set mode "
                          f"Default (nvidia-smi -i {prohibited[0]} -c DEFAULT)")
    shared = processes_sharing_a_gpu(cfg)
    exclusive = [f"GPU {i}: {m}" for i, m in modes.items() if m != "Default"]
    if shared and exclusive:
        raise ConfigError(f"GPU compute mode {', '.join(exclusive)}: {shared}, which needs mode Default "
                          "(nvidia-smi -c DEFAULT); an exclusive mode admits one process per GPU")
    if mps is not None:  # any placement: colocate's GPU paths are built and checked without MPS
        raise ConfigError(f"an MPS control daemon runs ({mps}/control) and CUDA would run the job's processes "
                          "under it: CUDA IPC between the trainer and the engine on a GPU does not work under MPS; "
                          "stop it (echo quit | nvidia-cuda-mps-control)")
    if shm_bytes < MIN_SHM_BYTES:
        raise ConfigError(f"/dev/shm has {shm_bytes / GIB:.2f} GiB free, under the {MIN_SHM_BYTES / GIB:.0f} GiB "
                          "NCCL and vLLM need: run the container with --ipc=host or --shm-size=16g")
    largest = max(host, key=host.get)
    if host[largest] > available_host_bytes:
        raise ConfigError(
            f"host memory: the job needs {host[largest] / GIB:.1f} GiB on this node ({largest}) but "
            f"{available_host_bytes / GIB:.1f} GiB is available; use fewer ranks per node (placement.num_slots, "
            f"now {cfg.placement.num_slots}) or a node with more memory")
