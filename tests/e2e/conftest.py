"""End-to-end tests: the real stack (Ray, FSDP2 on gloo, vLLM CPU with TP=2, shared-memory sync)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from colocate.config import JobConfig, load_config
from colocate.host.shm import mapped_by

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def small_job(tmp_path: Path, *overrides: str) -> JobConfig:
    """The default job, shrunk so a step takes a fraction of a second."""
    return load_config(str(ROOT / "configs" / "default.yaml"), [
        "rollout.num_prompts=4", "rollout.num_samples=4", "rollout.max_tokens=4", "algo.num_steps=2",
        "engine.kv_cache_gib=0.125", f"logging.output_dir={tmp_path / 'out'}", "logging.progress=false",
        "engine.sleep_level=2", "trainer.offload=true",  # the full switching order (auto would move nothing here)
        f"model.cache_dir={ROOT / '.cache' / 'models'}", *overrides])


_OURS = ("raylet", "gcs_server", "ray::", "VLLM", "EngineCore", "dashboard", "log_monitor", "runtime_env")

# Each test run (a pytest process, or an xdist worker) tags what it starts with a variable every child inherits
# (Ray's daemons and workers, vLLM's, a `ray start` head), so that the leak checks below count this run's
# processes, and not the segments another run's live processes map: a second suite or job beside this one
# (a loaded machine) is not a leak.
RUN_TAG = "COLOCATE_TEST_RUN"
os.environ[RUN_TAG] = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{uuid.uuid4().hex}"


# A semaphore (sem.mp-*) whose creator died unlinked (a SIGKILLed engine, before its job's close or `colocate clean`
# removes it) is mapped by no one and names no one: while another run is active it may be that run's. A test
# then defers the semaphores it finds new to the end of the session (tests/conftest.py), when every other run is
# gone and whatever is still there is a leak. Under xdist with two workers another run is always there: the other
# worker, whose gloo tests (tests/distributed) create semaphores in processes that carry no Ray or vLLM marker.
# Each deferred name keeps the test that found it, for the session-end report.
DEFERRED_SEMAPHORES: dict[str, str] = {}
_BESIDE_ANOTHER_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
_others_at_start = False
_current_test = ""


@pytest.fixture(autouse=True)
def _note_other_runs(request):
    global _others_at_start, _current_test
    _others_at_start = _BESIDE_ANOTHER_WORKER or other_runs_alive()
    _current_test = request.node.nodeid
    yield


def other_runs_alive() -> bool:
    """Whether a Ray or vLLM process started by another test run is alive (a run between two tests has none).
    Only those: a pytest worker's own multiprocessing resource tracker lives as long as the worker, and two
    workers waiting on each other's would each wait out the session-end check."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or _run_of(pid) in (None, os.environ[RUN_TAG]):
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in _OURS):
            return True
    return False


def _run_of(pid: int | str) -> str | None:
    """The test run a process belongs to (its RUN_TAG at exec), or None: not started by a test run."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(RUN_TAG.encode() + b"="):
            return entry.split(b"=", 1)[1].decode()
    return None


def colocate_processes() -> set[tuple[int, str]]:
    """This test run's processes that a job could leave behind (Ray daemons, actors, vLLM workers)."""
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in _OURS) and _run_of(pid) == os.environ[RUN_TAG]:
            found.add((int(pid), cmdline[:120]))
    return found


def shm_segments() -> set[str]:
    """Every shared-memory entry: ours (colocate-*), vLLM's (TP communicator, message queues), semaphores."""
    return {p.name for p in Path("/dev/shm").iterdir()}


def _mapped_by_other_runs(names: set[str]) -> set[str]:
    """The entries among `names` that a live process outside this run maps (the test beside this one); by
    inode, as the product does (colocate.host.shm.mapped_by): a semaphore's creator maps it unnamed.

    Untagged processes count too: the other xdist worker's own pytest process carries no run tag (the tag is set
    after its exec), and its gloo tests' multiprocessing queues are semaphores it alone maps while their spawned
    ranks start or after they exit (stop 30's CI failed test_gather_job on four of them, created beside it)."""
    ours = os.environ[RUN_TAG]
    others = [int(pid) for pid in os.listdir("/proc")
              if pid.isdigit() and int(pid) != os.getpid() and _run_of(pid) != ours]
    return mapped_by(names, pids=others)


def assert_nothing_left(before_procs: set, before_shm: set, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while True:
        left = colocate_processes() - before_procs
        shm = shm_segments() - before_shm
        if shm:
            shm -= _mapped_by_other_runs(shm)
        if shm and (_others_at_start or other_runs_alive()):
            semaphores = {name for name in shm if name.startswith("sem.")}
            DEFERRED_SEMAPHORES.update(dict.fromkeys(semaphores, _current_test))
            shm -= semaphores
        if (not left and not shm) or time.time() > deadline:
            break
        time.sleep(1)
    assert not shm, f"shared-memory segments left behind: {shm}"
    assert not left, f"processes left behind: {left}"


def sigint_ignored() -> None:
    """preexec_fn for a command under test: SIGINT ignored, as anything started in the background by a
    non-interactive shell inherits it (`make test &`, CI runners). colocate takes SIGINT back itself
    (colocate/host/signals.py); starting every command this way keeps the tests from passing only in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def checkpoint_tensors(checkpoint: Path, name: str = "trainer") -> dict:
    """Every tensor of a checkpoint's trainer state (model and optimizer), assembled from the ranks' shards;
    `name` critic: the critic's (algo.advantage=gae)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint / name)).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(checkpoint / name), no_dist=True)
    return state


def launch(tmp_path: Path, *overrides: str, timeout_s: float = 420,
           config: str | tuple[str, ...] = "configs/default.yaml", small: bool = True) -> subprocess.CompletedProcess:
    """`colocate launch CONFIG...` as a user runs it, with the small job's overrides (unless not `small`)."""
    shrink = ["rollout.num_prompts=4", "rollout.num_samples=4", "rollout.max_tokens=4"] if small else []
    args = [*shrink, "engine.kv_cache_gib=0.125", f"logging.output_dir={tmp_path / 'out'}",
            f"model.cache_dir={ROOT / '.cache' / 'models'}", *overrides]
    configs = [config] if isinstance(config, str) else list(config)
    return subprocess.run([str(Path(os.sys.executable).parent / "colocate"), "launch", *configs, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, preexec_fn=sigint_ignored)
