"""CUDA IPC transport: a second process maps the engine's device ring by handle, writes typed slices into it,
and the owner sees them; the handle is opened on the same physical GPU (matched by UUID, not index)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from colocate.sync.buffers import CudaIpcBuffer, attach, device_uuid, local_device_index, range_checksum


def _writer(handle, num_rows: int, queue) -> None:
    ring = attach(handle)
    rows = torch.arange(num_rows * 64, device=ring.device, dtype=torch.float32).view(num_rows, 64)
    ring[: rows.numel() * 2].view(torch.bfloat16).view(num_rows, 64).copy_(rows)
    torch.cuda.synchronize()
    queue.put(range_checksum(ring[: rows.numel() * 2]))


def test_second_process_writes_into_the_ring():
    owner = CudaIpcBuffer.create(1 << 20, device=torch.device("cuda", 0))
    owner.tensor.zero_()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_writer, args=(owner.handle, 16, queue))
    proc.start()
    checksum = queue.get(timeout=120)
    proc.join(120)
    assert proc.exitcode == 0
    expected = torch.arange(16 * 64, device="cuda", dtype=torch.float32).view(16, 64).to(torch.bfloat16)
    got = owner.tensor[: 16 * 64 * 2].view(torch.bfloat16).view(16, 64)
    assert torch.equal(got, expected)
    assert range_checksum(owner.tensor[: 16 * 64 * 2]) == checksum


def test_device_is_found_by_uuid():
    assert local_device_index(device_uuid(torch.device("cuda", 0))) == 0
