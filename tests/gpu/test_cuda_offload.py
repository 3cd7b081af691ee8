"""Trainer offload on CUDA: parameters and optimizer state leave the GPU (allocated memory drops by their size),
come back bit for bit into the same tensor objects, and the pinned host buffers are reused, not reallocated."""

from __future__ import annotations

import torch

from colocate.trainer.offload import DeviceToHostOffload


def test_offload_frees_device_memory_and_restores_exactly():
    model = torch.nn.Linear(4096, 4096, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values() if v.is_cuda]
    expected = [t.detach().clone() for t in tensors]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    offloader = DeviceToHostOffload()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    assert offloader.offload(tensors) == state_bytes
    assert allocated - torch.cuda.memory_allocated() >= state_bytes - (1 << 20)
    host = [h.data_ptr() for h in offloader._host]
    assert offloader.onload() == state_bytes
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    offloader.offload(tensors)
    assert [h.data_ptr() for h in offloader._host] == host  # pinned buffers reused on the hot path
    offloader.onload()
    model(torch.randn(8, 4096, device="cuda")).sum().backward()  # the module still trains

