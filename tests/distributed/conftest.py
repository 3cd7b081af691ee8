"""Helpers for CPU tests of distributed code: run a function on a gloo group of `world_size` processes."""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, init: bool, fn, args, errors):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args) if init else fn(rank, world_size, port, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    else:
        if dist.is_initialized():
            dist.barrier()  # leave together: see TrainerActor.shutdown (teardown race)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Hazard (teardown race, still seen after the barrier: 2 aborts in about 8 runs of tests/distributed, always
    # "terminate called without an active exception" in a rank at interpreter exit): C++ static destructors
    # meet a gloo/store thread still joinable. The work is done and checked; leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks are forked from a forkserver that imported these once per pytest process, not spawned: a spawned rank
# imported torch, transformers and the trainer again, about 5 CPU-s a rank, 10 a test, which was most of a small
# test's time on 2 cores. The forkserver only imports (importing torch starts no thread and touches no device), so
# forking it is safe. Hazard: a rank sees the environment of when the forkserver started (the first test here), not
# the test's: ranks that need a variable must be given it (as _entry does MASTER_ADDR and MASTER_PORT).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
            "torch.distributed.tensor", "transformers", "transformers.models.qwen2.modeling_qwen2",
            "transformers.models.qwen3_moe.modeling_qwen3_moe", "colocate.trainer.actor", "colocate.sync.shards",
            "colocate.sync.gather", "colocate.sync.broadcast", "tests.distributed.conftest"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


def run_distributed(fn, *args, world_size: int = 2, init: bool = True) -> None:
    """Run `fn(rank, world_size, *args)` on every rank of a gloo group; re-raise the first rank's failure.
    With init=False the function gets the port and starts the group itself: `fn(rank, world_size, port, *args)`."""
    errors = _CONTEXT.SimpleQueue()
    mp.start_processes(_entry, args=(world_size, _free_port(), init, fn, args, errors), nprocs=world_size,
                       join=False, start_method="forkserver").join()
    if not errors.empty():
        raise AssertionError(errors.get())
