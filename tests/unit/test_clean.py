"""`colocate clean` and the job record: a dead job's segments and processes go, and nothing of another job or
another user, nor anything of a job still running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from colocate.errors import CleanError
from colocate.host.clean import JobRecord, check_cleanable, clean, clean_runs
from colocate.host.procfs import process_entry, process_tree, same_process, start_ticks
from colocate.host.shm import JOB_ENV, SHM_DIR, mapped_by, remove_orphaned_entries, remove_stale_segments
from colocate.sync.buffers import ShmBuffer, ShmHandle, attach

NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="simulating another user needs root (chown, setuid)")


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def write_record(run_dir, job: str, **fields) -> dict:
    """A job record as the Runtime writes it, by default of a job whose controller is dead."""
    record = JobRecord(run_dir, job)
    record.data.update(controller={"pid": dead_pid(), "start": 0}, state="running", **fields)
    record.update()
    return record.data


@pytest.fixture(autouse=True)
def own_temp_dir(tmp_path, monkeypatch):
    """`clean` also sweeps every dead engine's vLLM socket directory under the system's temporary directory
    (host/rpc_dirs.py), not this job's alone. An e2e test beside this one (a SIGKILLed engine) would add a line to
    what these tests count: each test gets a temporary directory of its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


@pytest.fixture
def segments(monkeypatch):
    """Make segments as the actors of job `token` would; unlinks whatever is left at the end."""
    made = []

    def make(token: str, tag: str = "ring") -> ShmBuffer:
        monkeypatch.setenv(JOB_ENV, token)
        made.append(ShmBuffer.create(64, tag=tag))
        return made[-1]

    yield make
    for owner in made:
        owner.unlink()


def test_clean_removes_the_dead_jobs_segments_and_leaves_another_jobs(tmp_path, segments):
    a, b = segments("aaaa0001"), segments("bbbb0002")
    write_record(tmp_path / "a", "aaaa0001")
    lines = []
    assert clean(tmp_path / "a", say=lines.append) == (0, 1)
    assert not (SHM_DIR / a.name).exists() and (SHM_DIR / b.name).exists()
    assert lines == [f"removed segment {SHM_DIR / a.name}"]
    assert "cleaned_at" in json.loads((tmp_path / "a" / "job.json").read_text())


def test_clean_refuses_a_running_job_in_one_line(tmp_path, segments, capsys):
    from colocate.cli import main

    mine = segments("cccc0003")
    record = JobRecord(tmp_path, "cccc0003")  # this test process is the job's controller, and alive
    record.update(state="running")
    with pytest.raises(CleanError, match=rf"is still running \(pid {os.getpid()}\); stop it first: "
                                         rf"kill -INT {os.getpid()}$"):
        check_cleanable(tmp_path)
    assert main(["clean", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [(f"colocate: error: job {tmp_path} is still running (pid {os.getpid()}); stop it first: "
                    f"kill -INT {os.getpid()}")]
    assert (SHM_DIR / mine.name).exists()


def test_one_refused_run_dir_stops_the_command_before_anything_is_removed(tmp_path, segments):
    dead = segments("dddd0004")
    write_record(tmp_path / "dead", "dddd0004")
    JobRecord(tmp_path / "alive", "eeee0005").update(state="running")
    with pytest.raises(CleanError):
        clean_runs([str(tmp_path / "dead"), str(tmp_path / "alive")], say=lambda line: None)
    assert (SHM_DIR / dead.name).exists()


def test_a_closed_job_whose_controller_lives_on_may_be_cleaned(tmp_path):
    JobRecord(tmp_path, "ffff0006").update(state="closed")
    assert clean(tmp_path, say=lambda line: None) == (0, 0)


def test_another_hosts_or_users_job_is_refused(tmp_path):
    write_record(tmp_path / "h", "12340007", host="elsewhere")
    with pytest.raises(CleanError, match="ran on host 'elsewhere'"):
        check_cleanable(tmp_path / "h")
    write_record(tmp_path / "u", "12340008", uid=os.getuid() + 1)
    with pytest.raises(CleanError, match="belongs to uid"):
        check_cleanable(tmp_path / "u")
    with pytest.raises(CleanError, match="has no job.json"):
        check_cleanable(tmp_path / "nothing")


def test_dry_run_removes_nothing(tmp_path, segments):
    mine = segments("abcd0009")
    write_record(tmp_path, "abcd0009")
    lines = []
    assert clean(tmp_path, dry_run=True, say=lines.append) == (0, 1)
    assert (SHM_DIR / mine.name).exists() and lines == [f"would remove segment {SHM_DIR / mine.name}"]


def test_recorded_processes_are_stopped_but_not_a_reused_pid(tmp_path):
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        entry = process_entry(left.pid)
        # the record's start time differs: the pid now belongs to a later process, which is not the job's
        stranger = {"pid": reused.pid, "start": start_ticks(reused.pid) - 1}
        write_record(tmp_path, "abcd0010", processes=[entry, stranger])
        lines = []
        assert clean(tmp_path, say=lines.append) == (1, 0)
        assert left.wait(10) is not None and not same_process(entry)
        assert reused.poll() is None
        assert lines[0].startswith(f"stopped process {left.pid} (")
    finally:
        for proc in (left, reused):
            proc.kill()
            proc.wait()


def test_recorded_vllm_entries_go_only_when_nobody_maps_them(tmp_path, segments):
    orphan = SHM_DIR / f"psm_cleantest{os.getpid()}"
    orphan.write_bytes(b"\0" * 4096)
    live = segments("00000000")  # mapped by this process: another job's, still in use
    try:
        write_record(tmp_path, "abcd0011", shm=[orphan.name, live.name])
        assert clean(tmp_path, say=lambda line: None) == (0, 1)
        assert not orphan.exists() and (SHM_DIR / live.name).exists()
    finally:
        orphan.unlink(missing_ok=True)


def test_a_semaphore_held_only_by_its_creator_counts_as_mapped(tmp_path):
    # multiprocessing's named semaphores (vLLM's engine makes some, spawn context): glibc maps a temporary file
    # and renames it, so the creator's maps never show the name. By name a concurrent job's cleanup took it
    # for garbage and unlinked it before that job's spawned workers opened it.
    import multiprocessing

    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem" + lock._semlock.name.replace("/", ".")
    assert (SHM_DIR / name).exists()
    assert mapped_by({name}, pids=[os.getpid()]) == {name} and mapped_by({name}) == {name}
    assert remove_orphaned_entries({name}) == [] and (SHM_DIR / name).exists()
    write_record(tmp_path, "abcd0012", shm=[name])
    clean(tmp_path, say=lambda line: None)
    assert (SHM_DIR / name).exists()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert mapped_by({name}, pids=[int(child.stdout)]) == set()  # a process that does not map it (gone too)


def test_segments_named_after_the_jobs_dead_processes_go_too(tmp_path):
    pid = dead_pid()
    old_style = SHM_DIR / f"colocate-{pid}-ring-deadbeef"  # a segment from before job tokens
    old_style.write_bytes(b"x")
    try:
        write_record(tmp_path, "abcd0012", processes=[{"pid": pid, "start": 1}])
        assert clean(tmp_path, say=lambda line: None) == (0, 1)
        assert not old_style.exists()
    finally:
        old_style.unlink(missing_ok=True)


def test_without_run_dirs_every_unclosed_record_under_the_root_is_cleaned(tmp_path, segments):
    dead = segments("abcd0013")
    write_record(tmp_path / "outputs" / "dead", "abcd0013")
    JobRecord(tmp_path / "outputs" / "closed", "abcd0014").update(state="closed")
    JobRecord(tmp_path / "outputs" / "alive", "abcd0015").update(state="running")
    lines = []
    assert clean_runs([], root=str(tmp_path / "outputs"), say=lines.append) == 0
    assert not (SHM_DIR / dead.name).exists()
    assert any(line.startswith("skipped: job ") and "still running" in line for line in lines)
    assert lines[-1].startswith(f"colocate: cleaned {tmp_path / 'outputs' / 'dead'}: stopped 0 process(es), "
                                "removed 1 segment(s)")


def test_job_record_and_process_helpers(tmp_path):
    record = JobRecord(tmp_path / "run", "abcd0016")
    record.update(state="running")
    data = json.loads((tmp_path / "run" / "job.json").read_text())
    assert data["job"] == "abcd0016" and data["controller"]["pid"] == os.getpid()
    assert data["host"] == socket.gethostname() and data["uid"] == os.getuid()
    assert same_process(data["controller"]) and not same_process({"pid": dead_pid(), "start": 0})
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in {e["pid"] for e in process_tree(os.getpid())}
    finally:
        child.kill()
        child.wait()


# -------------------------------------------------------------------------------------------- another user

def other_user_segment(name: str):
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 64)
    os.chown(path, NOBODY, NOBODY)
    return path


@as_root
def test_another_users_segment_is_never_touched(tmp_path, segments):
    pid = dead_pid()
    theirs = other_user_segment(f"colocate-{pid}-abcd0017-ring-00000000")  # same token, dead pid: still not ours
    orphan = other_user_segment(f"psm_other{os.getpid()}")
    try:
        write_record(tmp_path, "abcd0017", processes=[{"pid": pid, "start": 1}], shm=[orphan.name])
        assert clean(tmp_path, say=lambda line: None) == (0, 0)
        assert theirs.name not in remove_stale_segments()
        assert remove_orphaned_entries({orphan.name}) == []
        assert theirs.exists() and orphan.exists()
        with pytest.raises(PermissionError, match="belongs to another user"):
            attach(ShmHandle(theirs.name, 64))
    finally:
        theirs.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)


@as_root
def test_another_user_cannot_open_our_segment(segments):
    mine = segments("abcd0018")
    pid = os.fork()
    if pid == 0:  # the child becomes uid 65534 and tries to map it
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.open(SHM_DIR / mine.name, os.O_RDONLY)
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 13  # EACCES: 0600 and not the owner
    assert (SHM_DIR / mine.name).exists()


def sleeper(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])


def test_a_ray_the_job_started_goes_unless_another_driver_uses_it(tmp_path):
    session = str(tmp_path / "session_2026-01-01_00-00-00_000000_1")
    daemon = sleeper(f"--log_dir={session}/logs")  # as gcs_server and the raylet name their session
    other_session = sleeper(f"--log_dir={session}2/logs")  # a session whose name extends ours: not ours
    gcs = socket.socket()
    gcs.bind(("127.0.0.1", 0))
    gcs.listen()
    connect = "import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); time.sleep(120)"
    driver = subprocess.Popen([sys.executable, "-c", connect, str(gcs.getsockname()[1])])
    try:
        accepted, _ = gcs.accept()  # the other driver is connected to "our" GCS
        write_record(tmp_path / "run", "abcd0019", ray={"started": True, "session_dir": session,
                                                        "gcs_address": f"127.0.0.1:{gcs.getsockname()[1]}"})
        lines = []
        assert clean(tmp_path / "run", say=lines.append) == (0, 0)
        assert lines == [f"kept Ray session {session}: another driver (pid {driver.pid}) still uses it"]
        assert daemon.poll() is None
        driver.kill()
        driver.wait()
        accepted.close()
        lines = []
        assert clean(tmp_path / "run", say=lines.append) == (1, 0)
        assert len(lines) == 1 and lines[0].startswith(f"stopped process {daemon.pid} (")
        assert daemon.wait(10) is not None and other_session.poll() is None
    finally:
        gcs.close()
        for proc in (daemon, other_session, driver):
            proc.kill()
            proc.wait()


def test_a_jobs_processes_are_found_by_its_token_whoever_started_them():
    """Runtime.close stops every process here that carries the job's token, recorded or not: a process started by
    another (a forkserver's child: fork without exec) shows the environment of its parent's exec, and counts."""
    from colocate.host.procfs import processes_with_env

    token, other = "0123abcd", "feedbeef"
    code = "import os, time; os.fork() == 0 and time.sleep(30); time.sleep(30)"  # the parent and a forked child
    ours = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, JOB_ENV: token})
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, JOB_ENV: other})
    try:
        deadline = time.monotonic() + 20
        while len(found := processes_with_env(JOB_ENV, token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {e["pid"] for e in found}
        assert ours.pid in pids and len(pids) == 2  # the child too, and nothing else
        assert {e["pid"] for e in process_tree(ours.pid)} == pids
        assert theirs.pid not in pids and os.getpid() not in pids
    finally:
        for p in process_tree(ours.pid):
            os.kill(p["pid"], 9)
        theirs.kill()
        ours.wait()
        theirs.wait()
