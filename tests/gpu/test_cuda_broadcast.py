"""The split sync's NCCL group (colocate/sync/broadcast.py): built with blocking wait, so a lost member makes the
survivors raise BroadcastError instead of torch's watchdog thread ending their processes. One GPU shows what
the group is (no watchdog thread, the process's environment as it was, a broadcast that works); two show a
member lost mid-sync. The gloo twin of the fault path is tests/distributed/test_broadcast.py."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import run_distributed

TIMEOUT_S = 60
LOST_TIMEOUT_S = 10


def _nccl_watchdogs() -> int:
    """Threads of this process that torch names as NCCL watchdogs (ProcessGroupNCCL.cpp, Watchdog::run)."""
    return sum((task / "comm").read_text().strip() == "pt_nccl_watchdg" for task in Path("/proc/self/task").glob("*"))


def _one_gpu_group(rank: int, world_size: int, port: int) -> None:
    import time

    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    from colocate.sync.broadcast import BLOCKING_WAIT, BroadcastChannel, open_store

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store, address = open_store("127.0.0.1", "one", size=1, timeout_s=TIMEOUT_S)
    before = os.environ.get(BLOCKING_WAIT)
    channel = BroadcastChannel.join(address, rank=0, size=1, device=device, timeout_s=TIMEOUT_S, store=store)
    data = torch.arange(256, device=device).to(torch.uint8)
    channel.broadcast(data)
    assert torch.equal(data.cpu(), torch.arange(256).to(torch.uint8))
    assert os.environ.get(BLOCKING_WAIT) == before  # set for this group's construction alone
    time.sleep(0.5)
    assert _nccl_watchdogs() == 0  # blocking wait: no thread that could end this process
    # the premise of the count: a group built without blocking wait has a watchdog thread of that name
    plain_store = PrefixStore("plain", TCPStore("127.0.0.1", 0, 1, is_master=True,
                                                timeout=datetime.timedelta(seconds=TIMEOUT_S)))
    plain = dist.ProcessGroupNCCL(plain_store, 0, 1, dist.ProcessGroupNCCL.Options())
    time.sleep(0.5)
    assert _nccl_watchdogs() == 1
    del plain


def test_the_broadcast_group_runs_without_a_watchdog_thread():
    run_distributed(_one_gpu_group, world_size=1, init=False)


def _lost_on_two_gpus(rank: int, world_size: int, port: int) -> None:
    from torch.distributed import TCPStore

    from colocate.sync.broadcast import BroadcastChannel, BroadcastError, StoreAddress, open_store

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    board = TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                     timeout=datetime.timedelta(seconds=TIMEOUT_S))
    if rank == 0:
        store, address = open_store("127.0.0.1", "lost", size=2, timeout_s=TIMEOUT_S)
        board.set("port", str(address.port))
        channel = BroadcastChannel.join(address, rank=0, size=2, device=device, timeout_s=LOST_TIMEOUT_S,
                                        store=store)
    else:
        board.wait(["port"])
        address = StoreAddress("127.0.0.1", int(board.get("port")), "lost")
        channel = BroadcastChannel.join(address, rank=1, size=2, device=device, timeout_s=LOST_TIMEOUT_S)
    data = torch.full((1 << 20,), rank, dtype=torch.uint8, device=device)
    channel.broadcast(data)
    torch.cuda.synchronize()
    assert int(data.max()) == 0
    if rank == 1:
        board.set("lost", "1")
        os._exit(0)  # the member is lost mid-sync: its process is gone
    board.wait(["lost"])
    with pytest.raises(BroadcastError, match=r"the broadcast group lost \(member 0 of 2\) lost a member"):
        channel.broadcast(data)
    assert float(torch.ones(4, device=device).sum()) == 4.0  # alive, and its GPU still computes


def test_a_lost_member_makes_the_survivor_raise_on_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks of one communicator on one GPU")
    run_distributed(_lost_on_two_gpus, world_size=2, init=False)
