"""WeightArena: parameters moved into one shared segment keep computing the same, are written in place through
another mapping, and `discard` frees their pages (sleep) in every mapping."""

from __future__ import annotations

import pytest
import torch

from colocate.host.memory import process_rss_bytes
from colocate.sync.arena import WeightArena
from colocate.sync.buckets import ALIGN
from colocate.sync.buffers import attach


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3), torch.nn.Linear(3, 10))


@pytest.fixture
def shared(model):
    """The model's parameters moved into an arena: (params by name, arena); the segment's name goes after."""
    params = dict(model.named_parameters())
    arena = WeightArena(params, tag="test")
    yield params, arena
    arena.unlink()


def test_parameters_move_into_the_arena_and_compute_the_same(model):
    x = torch.tensor([[1, 2, 3]])
    before = model(x)
    params = dict(model.named_parameters())
    arena = WeightArena(params, tag="test")
    try:
        assert torch.equal(model(x), before)
        assert arena.detached() == []
        assert all(o % ALIGN == 0 for o in arena.offsets.values())
        base = arena.tensor.data_ptr()
        assert all(p.data_ptr() == base + arena.offsets[n] for n, p in params.items())
    finally:
        arena.unlink()


def test_a_write_through_another_mapping_lands_in_the_parameter(shared):
    params, arena = shared
    other = attach(arena.handle)  # what a trainer rank maps
    weight = params["1.weight"]
    start = arena.offsets["1.weight"]
    new = torch.arange(weight.numel(), dtype=weight.dtype).view(weight.shape)
    other[start:start + new.numel() * new.element_size()].view(new.dtype).copy_(new.view(-1))
    assert torch.equal(weight, new)


def test_a_parameter_given_new_storage_is_reported_detached(shared):
    params, arena = shared
    params["1.bias"].data = params["1.bias"].data.clone()
    assert arena.detached() == ["1.bias"]


def test_discard_frees_the_pages_in_every_mapping_and_writes_bring_them_back():
    weight = torch.nn.Parameter(torch.ones(16 << 20, dtype=torch.uint8), requires_grad=False)  # 16 MiB
    arena = WeightArena({"w": weight}, tag="test")
    try:
        other = attach(arena.handle)
        resident = process_rss_bytes()
        arena.discard()
        assert resident - process_rss_bytes() >= 15 << 20  # the pages left this process
        assert int(other[: 1 << 20].sum()) == 0  # and every mapping reads zeros
        other.fill_(3)  # a sync writing after wake
        assert bool((weight == 3).all())
        assert arena.detached() == []
    finally:
        arena.unlink()
