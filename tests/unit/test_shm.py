"""/dev/shm hygiene (host/shm.py): segment names carry their creator's pid and job, stale and orphaned entries go,
and a job finds only its own segments."""

from __future__ import annotations

import multiprocessing as mp
import os

from colocate.host.shm import (
    JOB_ENV,
    SHM_DIR,
    job_segments,
    job_token,
    remove_orphaned_entries,
    remove_stale_segments,
    remove_when_unmapped,
    segment_job,
    segment_pid,
    vllm_entries,
)
from colocate.sync.buffers import ShmBuffer


def test_stale_segments_of_dead_owners_are_removed():
    proc = mp.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()
    stale = SHM_DIR / f"colocate-{proc.pid}-ring-deadbeef"
    stale.write_bytes(b"x")
    mine = ShmBuffer.create(64, tag="live")
    try:
        removed = remove_stale_segments()
        assert stale.name in removed and not stale.exists()
        assert (SHM_DIR / mine.name).exists()
    finally:
        mine.unlink()


def test_only_entries_nobody_maps_are_removed_as_orphans():
    orphan = SHM_DIR / "psm_colocate_test_orphan"
    orphan.write_bytes(b"\0" * 4096)
    live = ShmBuffer.create(4096, tag="live")  # mapped by this process
    try:
        removed = remove_orphaned_entries({orphan.name, live.name})
        assert removed == [orphan.name] and not orphan.exists()
        assert (SHM_DIR / live.name).exists()
    finally:
        orphan.unlink(missing_ok=True)
        live.unlink()


def _map_and_wait(path: str, mapped, release) -> None:
    import mmap

    with open(path, "r+b") as f:
        view = mmap.mmap(f.fileno(), 4096)
    mapped.set()
    release.wait(60)
    view.close()


def test_an_engine_finds_what_its_workers_map_and_unlinks_it_once_they_have_exited():
    """vLLM's CPU TP workers leave their all-reduce segments behind (host/shm.py vllm_entries): the engine records
    the entries its workers (its descendants) map, not colocate's nor semaphores, and unlinks them once unmapped."""
    ctx = mp.get_context("spawn")
    segment = SHM_DIR / f"vllm_dist_{os.getpid()}-tp:0-[0-1]-cpushm_0"
    segment.write_bytes(b"\0" * 4096)
    ours = ShmBuffer.create(4096, tag="ring")
    mapped, release = [ctx.Event(), ctx.Event()], ctx.Event()
    workers = [ctx.Process(target=_map_and_wait, args=(str(path), event, release))
               for path, event in zip([segment, SHM_DIR / ours.name], mapped)]
    try:
        for worker in workers:
            worker.start()
        assert all(event.wait(60) for event in mapped)
        assert vllm_entries(os.getpid()) == {segment.name}  # and not colocate's, which the second maps
        assert vllm_entries(workers[0].pid) == set()  # no worker of its own
        assert remove_when_unmapped({segment.name}, timeout_s=0.5) == {segment.name} and segment.exists()
        release.set()
        assert remove_when_unmapped({segment.name}, timeout_s=60) == set() and not segment.exists()
    finally:
        release.set()
        for worker in workers:
            worker.join(60)
        segment.unlink(missing_ok=True)
        ours.unlink()


# ----------------------------------------------------------------------------------- isolation (security)

def test_segment_names_carry_the_job_token_and_are_owner_only(monkeypatch):
    monkeypatch.setenv(JOB_ENV, "0123abcd")
    previous = os.umask(0)  # the mode must not depend on the caller's umask
    try:
        owner = ShmBuffer.create(64, tag="ring")
    finally:
        os.umask(previous)
    try:
        assert owner.name.startswith(f"colocate-{os.getpid()}-0123abcd-ring-")
        assert segment_job(owner.name) == "0123abcd" and segment_pid(owner.name) == os.getpid()
        assert (SHM_DIR / owner.name).stat().st_mode & 0o777 == 0o600
    finally:
        owner.unlink()


def test_two_jobs_get_distinct_segments_and_a_job_finds_only_its_own(monkeypatch):
    monkeypatch.setenv(JOB_ENV, "aaaaaaaa")
    a = ShmBuffer.create(64, tag="ring")
    monkeypatch.setenv(JOB_ENV, "bbbbbbbb")
    b = ShmBuffer.create(64, tag="ring")
    try:
        assert a.name != b.name
        assert [p.name for p in job_segments("aaaaaaaa")] == [a.name]
        assert [p.name for p in job_segments("bbbbbbbb")] == [b.name]
    finally:
        a.unlink()
        b.unlink()


def test_an_invalid_job_token_falls_back_to_one_of_this_process(monkeypatch):
    monkeypatch.setenv(JOB_ENV, "../../etc")
    assert job_token() != "../../etc" and len(job_token()) == 8
    monkeypatch.delenv(JOB_ENV)
    assert job_token() == job_token()  # stable within the process


def test_old_style_names_still_give_their_pid():
    assert segment_pid("colocate-123-ring-deadbeef") == 123 and segment_job("colocate-123-ring-deadbeef") is None
    assert segment_pid("psm_1234") is None
