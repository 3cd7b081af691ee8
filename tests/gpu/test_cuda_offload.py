"""Trainer offload on CUDA: parameters and optimizer state leave the GPU (allocated memory drops by their size),
come back bit for bit into the same tensor objects, and the module still trains.

- pinned: one exact-size page-locked host buffer (`host_layout(...).total`, not a power of two), reused while the
  state's storages stay the same; AdamW's CPU `step` scalars are left where they are.
- torch_memory_saver: what was allocated in `allocation_region()` is paused (the driver sees the memory free) and
  resumed in place."""

from __future__ import annotations

import pytest
import torch

from colocate.trainer.offload import PinnedOffload, host_layout, make_offloader

SIZE = 4096


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, SIZE, device="cuda")).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """As the trainer lists it: parameters, then every optimizer state tensor (the CPU `step` scalars included)."""
    return list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def _cuda_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if t.is_cuda)


def test_pinned_offload_frees_device_memory_and_restores_exactly():
    torch.manual_seed(0)
    model = torch.nn.Linear(SIZE, SIZE, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    tensors = _state(model, optimizer)
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
    step, so the next offload moves more storages: a new exact-size buffer, then reuse again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(SIZE, SIZE, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    offloader = make_offloader(torch.device("cuda"), backend="pinned")
    try:
        params = _state(model, optimizer)
        assert offloader.offload(params) == _cuda_bytes(params)
        assert offloader._host.numel() == host_layout(params, offloader.device).total
        offloader.onload()

        _step(model, optimizer)
        tensors = _state(model, optimizer)
        expected = [t.detach().clone() for t in tensors]
        total = host_layout(tensors, offloader.device).total
        assert offloader.offload(tensors) == _cuda_bytes(tensors)
        assert offloader._host.numel() == total
        host_ptr = offloader._host.data_ptr()
        offloader.onload()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))

        offloader.offload(tensors)
        assert offloader._host.data_ptr() == host_ptr and offloader._host.numel() == total
        offloader.onload()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
        _step(model, optimizer)
    finally:
        offloader.close()


def test_torch_memory_saver_offload_frees_device_memory_and_restores_exactly():
    pytest.importorskip("torch_memory_saver")
    offloader = make_offloader(torch.device("cuda"), backend="torch_memory_saver")
    assert offloader.name == "torch_memory_saver"
    torch.manual_seed(0)
    with offloader.allocation_region():  # as the trainer does: the parameters in the region...
        model = torch.nn.Linear(SIZE, SIZE, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, SIZE, device="cuda")).sum().backward()
    with offloader.allocation_region():  # ...and the optimizer state, created at the first step
        optimizer.step()
    model.zero_grad(set_to_none=True)
    tensors = _state(model, optimizer)
    expected = [t.detach().clone() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    state_bytes = _cuda_bytes(tensors)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # only what the offload itself frees counts below
    free_before = torch.cuda.mem_get_info()[0]
    assert offloader.offload(tensors) == state_bytes
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] - free_before >= 0.9 * state_bytes  # the driver sees it free

    assert offloader.onload() == state_bytes
    assert [t.data_ptr() for t in tensors] == pointers  # same virtual addresses
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))  # bit for bit
    _step(model, optimizer)  # the module still trains
    offloader.close()
