"""Shared-memory transport: another process writes, we read; names vanish after unlink; stale segments go."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from colocate.sync.transport import SHM_DIR, ShmBuffer, ShmHandle, attach, range_checksum, remove_stale_segments


def _write(handle: ShmHandle, value: int) -> None:
    view = attach(handle)
    view[:16].fill_(value)


def test_other_process_writes_are_visible_and_unlink_keeps_mappings():
    owner = ShmBuffer.create(1 << 16, tag="t")
    try:
        proc = mp.get_context("spawn").Process(target=_write, args=(owner.handle, 7))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert owner.tensor[:16].tolist() == [7] * 16
        reader = attach(owner.handle)
        owner.unlink()
        assert not (SHM_DIR / owner.name).exists()
        reader[16:32].fill_(3)  # the memory outlives the name
        assert owner.tensor[16:32].tolist() == [3] * 16
    finally:
        owner.unlink()


def test_typed_views_round_trip_bf16():
    owner = ShmBuffer.create(4096, tag="t")
    try:
        source = torch.randn(8, 16).to(torch.bfloat16)
        owner.tensor[:256].view(torch.bfloat16).view(8, 16).copy_(source)
        assert torch.equal(attach(owner.handle)[:256].view(torch.bfloat16).view(8, 16), source)
    finally:
        owner.unlink()


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


def test_checksum_sees_a_single_byte_change():
    data = torch.zeros(1024, dtype=torch.uint8)
    before = range_checksum(data)
    data[500] = 1
    assert range_checksum(data) != before


def test_only_entries_nobody_maps_are_removed_as_orphans():
    from colocate.sync.transport import remove_orphaned_entries

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


# ----------------------------------------------------------------------------------- isolation (security)

def test_segment_names_carry_the_job_token_and_are_owner_only(monkeypatch):
    from colocate.sync.transport import JOB_ENV, segment_job, segment_pid

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
    from colocate.sync.transport import JOB_ENV, job_segments

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
    from colocate.sync.transport import JOB_ENV, job_token

    monkeypatch.setenv(JOB_ENV, "../../etc")
    assert job_token() != "../../etc" and len(job_token()) == 8
    monkeypatch.delenv(JOB_ENV)
    assert job_token() == job_token()  # stable within the process


def test_old_style_names_still_give_their_pid():
    from colocate.sync.transport import segment_job, segment_pid

    assert segment_pid("colocate-123-ring-deadbeef") == 123 and segment_job("colocate-123-ring-deadbeef") is None
    assert segment_pid("psm_1234") is None
