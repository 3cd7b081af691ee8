"""Trainer offload on CUDA: parameters and optimizer state leave the GPU (allocated memory drops by their size),
come back bit for bit into the same tensor objects, and the module still trains.

- pinned: one exact-size page-locked host buffer (`host_layout(...).total`, not a power of two), reused while the
  state's storages stay the same; AdamW's CPU `step` scalars are left where they are.
- torch_memory_saver: what was allocated in `allocation_region()` is paused (the driver sees the memory free) and
  resumed in place; offload and onload both report the pool's segments, which the pause moves whole.

The scenario of the last two tests is `offload_before_optimizer_state` (colocate/bench/gpu_check/offload.py),
which the GPU check runs for each backend and its CPU mode runs through the file tier in CI
(tests/unit/test_gpu_check.py): the same product calls on both devices."""

from __future__ import annotations

import pytest
import torch

from colocate.bench.gpu_check.offload import offload_before_optimizer_state, trainer_state
from colocate.trainer.offload import PinnedOffload, host_layout, make_offloader

SIZE = 4096
CUDA = torch.device("cuda", 0)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, SIZE, device="cuda")).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def _cuda_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if t.is_cuda)


def test_pinned_offload_frees_device_memory_and_restores_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(SIZE, SIZE, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    tensors = trainer_state(model, optimizer)
    steps = [t for t in tensors if not t.is_cuda]
    assert steps, "AdamW (neither fused nor capturable) keeps its step scalars on the CPU"
    steps_before = [(s.clone(), s.data_ptr()) for s in steps]
    expected = [t.detach().clone() for t in tensors]
    state_bytes = _cuda_bytes(tensors)

    offloader = make_offloader(torch.device("cuda"), backend="pinned")
    assert isinstance(offloader, PinnedOffload)
    layout = host_layout(tensors, offloader.device)
    assert layout.total >= state_bytes and layout.total & (layout.total - 1)  # exact, not a power of two
    try:
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        assert offloader.offload(tensors) == state_bytes
        assert allocated - torch.cuda.memory_allocated() >= state_bytes - (1 << 20)
        assert offloader._host.numel() == layout.total  # one exact-size host buffer
        host_ptr = offloader._host.data_ptr()
        for step, (value, ptr) in zip(steps, steps_before):  # the CPU state is not ours: untouched, still there
            assert step.device.type == "cpu" and step.data_ptr() == ptr and torch.equal(step, value)

        assert offloader.onload() == state_bytes
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))  # bit for bit, same tensor objects

        assert offloader.offload(tensors) == state_bytes
        assert offloader._host.data_ptr() == host_ptr  # the host buffer is reused on the hot path
        assert offloader._host.numel() == layout.total
        assert offloader.onload() == state_bytes
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
        for step, (value, ptr) in zip(steps, steps_before):
            assert step.device.type == "cpu" and step.data_ptr() == ptr and torch.equal(step, value)

        _step(model, optimizer)  # the module still trains
        assert not torch.equal(model.weight, expected[0])
    finally:
        offloader.close()


def test_pinned_offload_before_the_optimizer_state_exists():
    """The controller offloads before the first step (the engine runs first); AdamW creates its state at that
    step, so the next offload moves more storages: a new exact-size buffer, then reuse again. Every expected
    byte count is read before its offload (the first GPU run compared with storages the offload had emptied)."""
    got = offload_before_optimizer_state(CUDA, backend="pinned", size=SIZE)
    assert got["status"] == "pass", got
    assert got["params_offloaded"] == got["params_onloaded"] == got["params_bytes"]
    assert got["params_host_numel"] == got["params_layout_total"]  # exact for the parameters alone
    first, second = got["rounds"]
    assert first["offloaded"] == first["onloaded"] == got["state_bytes"] > got["params_bytes"]
    assert first["host_numel"] == got["state_layout_total"]  # a new exact-size buffer once the state exists
    assert second["host_ptr"] == first["host_ptr"] and second["host_numel"] == first["host_numel"]  # then reused
    assert all(r["bit_exact"] for r in got["rounds"]) and got["trains_after"]
    # the offload empties torch's cache: the driver gets the memory back (vLLM's wake allocates from the driver)
    assert all(r["freed"] >= 0.9 * got["state_bytes"] for r in got["rounds"])


def test_torch_memory_saver_offload_frees_device_memory_and_restores_exactly():
    """Offload and onload report the same bytes: the pool's segments, which the pause backs up and unmaps whole
    and the resume maps back (trainer/memory_saver.py). The first GPU run read 270,532,608 back for 201,375,744
    offloaded: its offload counted the storages only, and the test ran an optimizer step inside the region, whose
    64 MiB temporary stayed reserved in the pool. Here the state is created the trainer's way (by hand in the
    region), so the pool holds the state and the one 2 MiB segment its small tensors share."""
    pytest.importorskip("torch_memory_saver")
    got = offload_before_optimizer_state(CUDA, backend="torch_memory_saver", size=SIZE)
    assert got["status"] == "pass", got
    small_segment = 2 << 20  # torch's caching allocator: blocks under 1 MiB come from 2 MiB segments
    for r in got["rounds"]:
        assert r["offloaded"] == r["onloaded"]
        assert got["state_bytes"] <= r["offloaded"] <= got["state_bytes"] + small_segment
        assert r["freed"] >= 0.9 * got["state_bytes"]  # the driver sees it free
        assert r["same_addresses"] and r["bit_exact"]  # the same virtual addresses, bit for bit
    assert got["trains_after"]
