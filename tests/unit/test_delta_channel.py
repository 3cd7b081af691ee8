"""sync.delta's two ends on one process (sync/delta_channel.py): the broadcast group replaced at its boundary by a
pipe that hands the sender's tensors to the receiver in order (tests/distributed/test_broadcast.py runs the real
gloo groups). A delta taken against another version than the receiver holds is refused with nothing applied; the
figures count what was sent; a slice that does not divide into the dtype's width is compared byte by byte."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.sync.delta_channel import HEADER, DeltaMismatch, DeltaReceiver, DeltaSender, element_view


class Pipe:
    """The sender's broadcasts, received in order by the receiver (one member each side)."""

    def __init__(self):
        self.queue = deque()

    def sender(self):
        return _End(self, send=True)

    def receiver(self):
        return _End(self, send=False)


class _End:
    def __init__(self, pipe: Pipe, *, send: bool):
        self.pipe, self.send = pipe, send

    def broadcast(self, data: torch.Tensor) -> None:
        if self.send:
            self.pipe.queue.append(data.clone())
        else:
            data.copy_(self.pipe.queue.popleft())


def _weights(seed: int, n: int = 4096) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).view(torch.uint8)


def test_round_trips_and_counts_what_it_sent():
    pipe = Pipe()
    sender, receiver = DeltaSender(pipe.sender(), element_size=2), DeltaReceiver(pipe.receiver(), element_size=2)
    current = _weights(0)
    ring = torch.zeros_like(current)
    sender.send(3, current, version=0)
    receiver.receive(3, ring)
    assert torch.equal(ring, current) and receiver.store.version == sender.store.version == 0
    first = sender.take_stats().record()
    assert first["density"] == 1.0 and first["sent_bytes"] == current.numel() + 8 * HEADER
    changed = current.view(torch.bfloat16).clone()
    changed[::64] += 1.0  # 64 of 4096 weights
    changed = changed.view(torch.uint8)
    sender.send(3, changed, version=1)
    ring.zero_()  # the ring slot held another bucket since: the store, not the slot, is the delta's base
    receiver.receive(3, ring)
    assert torch.equal(ring, changed) and receiver.store.version == 1
    second = sender.take_stats().record()
    assert second["changed"] == 64 and second["density"] == 64 / 4096
    assert second["sent_bytes"] < 0.1 * second["full_bytes"]


def test_a_delta_against_another_version_is_refused_and_nothing_applied():
    pipe = Pipe()
    sender, receiver = DeltaSender(pipe.sender(), element_size=2), DeltaReceiver(pipe.receiver(), element_size=2)
    ring = torch.zeros(4096 * 2, dtype=torch.uint8)
    sender.send(0, _weights(0), version=0)
    receiver.receive(0, ring)
    sender.send(0, _weights(1), version=1)
    pipe.queue.clear()  # the receiver missed version 1
    sender.send(0, _weights(2), version=2)
    held = receiver.store.slices[0].clone()
    with pytest.raises(DeltaMismatch, match="a delta against version 1 reached a store holding version 0; nothing"):
        receiver.receive(0, ring)
    assert torch.equal(receiver.store.slices[0], held) and receiver.store.version == 0
    assert not pipe.queue  # every part of the slice was taken off the group: its members stay in step


def test_a_slice_off_the_dtype_width_is_compared_byte_by_byte():
    odd = torch.arange(7, dtype=torch.uint8)
    assert element_view(odd, 2).dtype == torch.uint8 and element_view(odd[:6], 2).dtype == torch.int16
    assert element_view(odd[1:7], 2).dtype == torch.uint8  # its offset is not the width's multiple


@pytest.mark.parametrize("overrides, line", [
    (["sync.delta=true"], "sync.delta='true' is invalid: sends the changes over the split placement's broadcast"),
    (["sync.delta=true", "placement.num_slots=3", "placement.engine_slots=2", "trainer.lora.rank=8"],
     "sync.delta='true' is invalid: a LoRA job (trainer.lora.rank=8) syncs its adapters alone"),
    (["sync.delta=maybe"], "sync.delta='maybe' is invalid: valid: auto, true, false"),
])
def test_a_delta_with_a_sync_that_cannot_use_it_is_one_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides).check()
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_auto_is_on_for_the_broadcast_and_off_co_located():
    from colocate.job.resolve import resolve_job

    split = resolve_job(load_config(None, ["placement.num_slots=3", "placement.engine_slots=2"]), device="cpu")
    colocated = resolve_job(load_config(None, []), device="cpu")
    assert split.config.sync.delta == "true" and colocated.config.sync.delta == "false"
    assert any(line.startswith("sync.delta: true (the broadcast sends") for line in split.describe())
