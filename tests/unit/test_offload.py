"""Trainer offload on the CPU: the pinned buffer's layout (aligned, packed, exact, one slice per storage), which
storages belong to a device, which backend a device gets, and the file tier's round trip."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from colocate.errors import ConfigError
from colocate.host.storages import device_storages
from colocate.trainer.offload import (
    HOST_ALIGN,
    FileOffload,
    host_layout,
    make_offloader,
    memory_saver_problem,
    select_backend,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it


def _tensors(*sizes_dtypes):
    torch.manual_seed(0)
    return [torch.randn(n).to(dtype) for n, dtype in sizes_dtypes]


# ------------------------------------------------------------------------------------------------ host_layout

@pytest.mark.parametrize("tensors", [
    pytest.param(lambda: _tensors((1, torch.uint8)), id="one-byte"),
    pytest.param(lambda: _tensors((3, torch.uint8), (5, torch.float16), (7, torch.float32)), id="unaligned-sizes"),
    pytest.param(lambda: _tensors((16, torch.float32), (16, torch.float32)), id="aligned-sizes"),
    pytest.param(lambda: _tensors((1000, torch.float32), (1, torch.bfloat16), (333, torch.float64),
                                  (65, torch.uint8)), id="mixed"),
])
def test_host_layout_is_aligned_packed_and_exact(tensors):
    tensors = tensors()
    layout = host_layout(tensors, CPU)
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    assert list(layout.sizes) == sizes
    assert layout.offsets[0] == 0
    assert all(offset % HOST_ALIGN == 0 for offset in layout.offsets)
    for (start, size), next_start in zip(zip(layout.offsets, layout.sizes), layout.offsets[1:]):
        assert start + size <= next_start < start + size + HOST_ALIGN  # no overlap, no more padding than needed
    assert layout.total == layout.offsets[-1] + layout.sizes[-1]  # exact: no padding after the last slice


def test_host_layout_counts_a_shared_storage_once():
    base, other = _tensors((100, torch.float32), (10, torch.float32))
    view = base[10:50]
    layout = host_layout([base, view, other, base], CPU)
    assert len(layout.storages) == 2
    assert layout.sizes == (400, 40)
    assert layout.offsets == [0, 448]
    assert layout.total == 448 + 40


@pytest.mark.parametrize("tensors", [
    pytest.param([], id="none"),
    pytest.param([torch.empty(0)], id="empty-storage"),
])
def test_host_layout_of_nothing_is_empty(tensors):
    layout = host_layout(tensors, CPU)
    assert (layout.storages, layout.offsets, layout.sizes, layout.total) == ([], [], (), 0)


# -------------------------------------------------------------------------------------------- device_storages

@pytest.mark.parametrize("device", [
    pytest.param(torch.device("meta"), id="meta"),
    pytest.param(CUDA, id="cuda"),
])
def test_device_storages_leave_out_other_devices(device):
    cpu = _tensors((8, torch.float32), (1, torch.float32))  # e.g. AdamW's `step` scalars beside CUDA state
    assert device_storages(cpu, device) == []


def test_device_storages_keep_the_devices_own_once_in_order():
    a, b = _tensors((8, torch.float32), (4, torch.float32))
    meta = torch.empty(4, device="meta")
    storages = device_storages([b, meta, a, b[1:], a], CPU)
    assert [s.data_ptr() for s in storages] == [b.untyped_storage().data_ptr(), a.untyped_storage().data_ptr()]
    assert all(s.device == CPU for s in storages)


# --------------------------------------------------------------------------------------------- select_backend

MISSING = "the torch-memory-saver package is not installed"


@pytest.mark.parametrize("backend", [
    pytest.param("auto", id="auto"),
    pytest.param("pinned", id="pinned"),
    pytest.param("torch_memory_saver", id="torch_memory_saver"),
])
def test_the_cpu_always_gets_the_file_tier(backend):
    assert select_backend(CPU, backend=backend, memory_saver_problem=MISSING) == "file"


@pytest.mark.parametrize("device", [pytest.param(CPU, id="cpu"), pytest.param(CUDA, id="cuda")])
def test_an_unknown_backend_is_refused(device):
    with pytest.raises(ConfigError, match="trainer.offload_backend='cuda_ipc'") as info:
        select_backend(device, backend="cuda_ipc", memory_saver_problem=None)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("problem, backend, expected", [
    pytest.param(None, "auto", "torch_memory_saver", id="auto-usable"),
    pytest.param(None, "torch_memory_saver", "torch_memory_saver", id="asked-usable"),
    pytest.param(None, "pinned", "pinned", id="pinned-usable"),
    pytest.param(MISSING, "auto", "pinned", id="auto-missing"),
    pytest.param(MISSING, "pinned", "pinned", id="pinned-missing"),
])
def test_cuda_backend_choice(problem, backend, expected):
    assert select_backend(CUDA, backend=backend, memory_saver_problem=problem) == expected


def test_torch_memory_saver_asked_for_where_it_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="trainer.offload_backend='torch_memory_saver'.*not installed") as info:
        select_backend(CUDA, backend="torch_memory_saver", memory_saver_problem=MISSING)
    assert "\n" not in str(info.value)


def test_what_keeps_torch_memory_saver_from_running(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments" in memory_saver_problem()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    installed = importlib.util.find_spec("torch_memory_saver") is not None
    assert memory_saver_problem() == (None if installed else MISSING)


# ------------------------------------------------------------------------------------------------ FileOffload

@pytest.fixture
def file_offloader(tmp_path):
    offloader = make_offloader(CPU, directory=str(tmp_path))
    yield offloader
    offloader.close()


def test_the_cpu_offloader_is_the_file_tier(file_offloader, tmp_path):
    assert isinstance(file_offloader, FileOffload)
    assert file_offloader.name == "file"
    assert list(tmp_path.iterdir()) == []  # the file's name goes at once
    with file_offloader.allocation_region():
        torch.ones(4)


def test_file_offload_round_trip_keeps_values_and_identity(file_offloader):
    base, other = _tensors((1 << 16, torch.float32), (1000, torch.bfloat16))
    view = base[100:300]
    tensors = [base, view, other]
    expected = [t.clone() for t in tensors]
    state_bytes = base.untyped_storage().nbytes() + other.untyped_storage().nbytes()
    storages = [t.untyped_storage() for t in tensors]

    assert file_offloader.offload(tensors) == state_bytes
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # released, not copied
    assert file_offloader.onload() == state_bytes
    for t, e, storage in zip(tensors, expected, storages):
        assert torch.equal(t, e)
        assert t.untyped_storage()._cdata == storage._cdata  # the same storage object, resized back
    assert view.data_ptr() == base.data_ptr() + 100 * base.element_size()  # the view still views its base
    assert file_offloader.onload() == 0  # nothing held any more


def test_file_offload_twice_reuses_the_file_and_the_module_still_trains(file_offloader):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()]
    state_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
    for _ in range(2):
        expected = [t.clone() for t in tensors]
        assert file_offloader.offload(tensors) == state_bytes
        assert file_offloader.onload() == state_bytes
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)


def test_file_offload_of_nothing_moves_nothing(file_offloader):
    assert file_offloader.offload([torch.empty(0)]) == 0
    assert file_offloader.onload() == 0
