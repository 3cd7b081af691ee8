"""torch_memory_saver's pause/resume guarded in Python: every transition its C++ core would answer with
`exit(1)` is refused with a named error, and a resume that cannot fit in the device's free memory raises a
JobFault naming the rank and the shortfall, before the package is called. The package is faked at its boundary
(`FakeSaver` ends the "process" exactly where the real core would); the offloader runs on the CPU device, so
its storages are real tensors and the byte counts are theirs."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from colocate.errors import DeviceMemoryShortfall, JobFault, MemorySaverError
from colocate.trainer import memory_saver
from colocate.trainer.memory_saver import RESUME_MARGIN_BYTES, MemorySaverOffload

GIB = 1 << 30


class CoreExit(BaseException):
    """What `exit(1)` in torch_memory_saver's C++ core would do to the process."""


class FakeSaver:
    """The package's singleton as 0.0.10 behaves: one state per tag, exit(1) on a wrong transition."""

    def __init__(self):
        self.paused: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool):
        assert enable_cpu_backup
        self.calls.append(("region", tag))
        yield

    def pause(self, tag: str) -> None:
        if tag in self.paused:
            raise CoreExit("double pause")
        self.paused.add(tag)
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        if tag not in self.paused:
            raise CoreExit("resume without pause")
        self.paused.discard(tag)
        self.calls.append(("resume", tag))


@pytest.fixture
def saver(monkeypatch):
    # the device calls around pause/resume, on a machine without CUDA
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(memory_saver, "_PAUSED", {})  # the process-wide table, fresh per test
    return FakeSaver()


def offloader(saver, *, tag="colocate-trainer", free=80 * GIB, owner="trainer rank 3"):
    return MemorySaverOffload(torch.device("cpu"), tag=tag, owner=owner, saver=saver, free_bytes=lambda: free)


def state(num_bytes: int = 4 << 20) -> list[torch.Tensor]:
    return [torch.zeros(num_bytes // 4), torch.zeros(16)]


def test_offload_then_onload_pauses_and_resumes_once(saver):
    o = offloader(saver)
    tensors = state()
    with o.allocation_region():
        pass
    assert o.offload(tensors) == (4 << 20) + 64
    assert o.onload() == (4 << 20) + 64
    assert saver.calls == [("region", "colocate-trainer"), ("pause", "colocate-trainer"),
                           ("resume", "colocate-trainer")]


def test_a_second_offload_is_refused_before_the_package_would_end_the_process(saver):
    o = offloader(saver)
    o.offload(state())
    with pytest.raises(MemorySaverError, match=r"trainer rank 3: torch_memory_saver tag 'colocate-trainer' is "
                                               r"already paused"):
        o.offload(state())
    assert saver.calls == [("pause", "colocate-trainer")]


def test_a_second_offloader_of_the_same_tag_in_the_process_is_refused_too(saver):
    offloader(saver).offload(state())
    with pytest.raises(MemorySaverError, match="already paused"):
        offloader(saver).offload(state())


def test_an_onload_without_an_offload_is_refused(saver):
    with pytest.raises(MemorySaverError, match="tag 'colocate-trainer' is not paused"):
        offloader(saver).onload()
    o = offloader(saver)
    o.offload(state())
    o.onload()
    with pytest.raises(MemorySaverError, match="is not paused"):
        o.onload()
    assert saver.calls == [("pause", "colocate-trainer"), ("resume", "colocate-trainer")]


def test_allocating_in_a_paused_region_is_refused(saver):
    o = offloader(saver)
    o.offload(state())
    with pytest.raises(MemorySaverError, match="while it is paused"):
        with o.allocation_region():
            pass


def test_tags_pause_apart(saver):
    policy, reference = offloader(saver), offloader(saver, tag="colocate-reference")
    policy.offload(state())
    reference.offload(state())
    reference.onload()
    policy.onload()
    assert not saver.paused


def test_a_resume_that_cannot_fit_names_the_rank_and_the_shortfall_and_keeps_the_state_paused(saver):
    tensors = state(1 << 30)
    o = offloader(saver, free=1 << 29)
    o.offload(tensors)
    need = (1 << 30) + 64 + RESUME_MARGIN_BYTES
    with pytest.raises(DeviceMemoryShortfall) as caught:
        o.onload()
    message = str(caught.value)
    assert isinstance(caught.value, JobFault)  # a fault of the job: fault.max_restarts may restart it
    assert message.startswith("trainer rank 3 cannot bring its state back on cpu")
    assert f"needs {need / GIB:.2f} GiB" in message and "has 0.50 GiB free" in message
    assert f"short by {(need - (1 << 29)) / GIB:.2f} GiB" in message
    assert saver.paused == {"colocate-trainer"}  # nothing was resumed: a retry once memory is free can still resume
    o._free_bytes = lambda: 80 * GIB
    assert o.onload() == (1 << 30) + 64


class FakePool:
    """torch.cuda.MemPool's snapshot as the package's pool table holds it: whole segments, not blocks."""

    def __init__(self, segment_sizes: list[int]):
        self.segment_sizes = segment_sizes

    def snapshot(self) -> list[dict]:
        return [{"total_size": size} for size in self.segment_sizes]


def test_offload_and_onload_both_report_the_pools_segments_which_the_pause_moves(saver):
    """The core pauses and resumes whole segments (csrc/core.cpp: one allocation per segment of the pool), which
    hold more than the storages given (small tensors share a 2 MiB segment; blocks freed in the region stay
    reserved): both directions report the segments, as the first GPU run's onload did (270,532,608 bytes) while
    its offload reported the storages alone (201,375,744)."""
    tensors = state()
    segments = [4 << 20, 2 << 20, 64 << 20]  # the state's, a small-block segment, a temporary's freed block
    saver._impl = SimpleNamespace(_mem_pools={("colocate-trainer", True, False, "pinned", None): FakePool(segments),
                                              ("another-tag", True, False, "pinned", None): FakePool([1 << 30])})
    o = offloader(saver)
    moved = o.offload(tensors)
    assert moved == sum(segments) > (4 << 20) + 64  # this tag's segments only, more than the storages
    assert o.onload() == moved
