"""Shared-memory buffers (sync/buffers.py): another process writes, we read; the name goes at unlink, the mapping
stays; typed views round-trip; the checksum sees one byte."""

from __future__ import annotations

import multiprocessing as mp

import torch

from colocate.host.shm import SHM_DIR
from colocate.sync.buffers import ShmBuffer, ShmHandle, attach, range_checksum


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


def test_checksum_sees_a_single_byte_change():
    data = torch.zeros(1024, dtype=torch.uint8)
    before = range_checksum(data)
    data[500] = 1
    assert range_checksum(data) != before
