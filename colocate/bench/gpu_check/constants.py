"""The preflight's per-process constants, measured (colocate/job/preflight.py).

CUDA: a second process's CUDA context with cuBLAS (CUDA_CONTEXT_BYTES) and its NCCL communicator at world size 1
(NCCL_COMMUNICATOR_BYTES; 8 ranks take more), each the driver's free memory before and after, read from this
process while the child holds it. Not measurable on the lent machine (no vLLM): ENGINE_ASLEEP_BYTES and
CUDA_GRAPH_POOL_BYTES, listed as such.
CPU: the same child, the same steps (a matmul, then a process group of world size 1 over gloo with its two
collectives), each reading the child's own RSS, held against TRAINER_PROCESS_BYTES (the child comes from the
check's forkserver, which imported torch, transformers and the trainer, as a trainer rank has).
"""

from __future__ import annotations

import os
import traceback

import torch

from colocate.bench.gpu_check.common import context, free_bytes, free_port, receive


def _context_child(device_type: str, port: int, steps, results) -> None:
    """A fresh process: its device context (with a cuBLAS matmul on CUDA), then a process group of world size 1,
    waiting after each for the parent's reading."""
    try:
        import torch.distributed as dist

        from colocate.host.memory import process_rss_bytes

        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        a = torch.ones(256, 256, device=device)
        (a @ a).sum().item()
        results.put(("context", process_rss_bytes()))
        steps.get()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0, world_size=1,
                                **({"device_id": device} if device_type == "cuda" else {}))
        t = torch.ones(1 << 20, device=device)
        dist.all_reduce(t)
        dist.all_gather_into_tensor(torch.empty(1 << 20, device=device), t)
        if device_type == "cuda":
            torch.cuda.synchronize()
        results.put(("group", process_rss_bytes()))
        steps.get()
        dist.destroy_process_group()
        results.put(("done", 0))
    except BaseException:
        results.put(("error", traceback.format_exc()[-3000:]))


def constants_section(device: torch.device) -> dict:
    from colocate.job import preflight

    cuda = device.type == "cuda"
    ctx = context()
    steps, results = ctx.Queue(), ctx.Queue()
    free = {"before": free_bytes()} if cuda else {}
    rss = {}
    child = ctx.Process(target=_context_child, args=(device.type, free_port(), steps, results))
    child.start()
    try:
        for stage in ("context", "group"):
            got, value = receive(results, [child], 120)
            if got != stage:
                return {"status": "fail", "error": str(value).strip().splitlines()[-1], "traceback": value}
            rss[stage] = value
            if cuda:
                free[stage] = free_bytes()
            steps.put("next")
        receive(results, [child], 60)
    finally:
        child.join(30)
        if child.is_alive():
            child.terminate()
    if cuda:
        readings = {"cuda_context_bytes": free["before"] - free["context"],
                    "nccl_communicator_bytes_world_1": free["context"] - free["group"]}
        estimates = {"cuda_context_bytes": preflight.CUDA_CONTEXT_BYTES,
                     "nccl_communicator_bytes_world_1": preflight.NCCL_COMMUNICATOR_BYTES}
        extra = {"free": free, "not_measured_here": {
            "ENGINE_ASLEEP_BYTES": "needs vLLM's sleep mode (no vLLM on the lent machine)",
            "CUDA_GRAPH_POOL_BYTES": "needs vLLM's graph capture (no vLLM on the lent machine)"}}
    else:
        readings = {"trainer_process_bytes": rss["context"], "gloo_group_bytes_world_1": rss["group"] - rss["context"]}
        estimates = {"trainer_process_bytes": preflight.TRAINER_PROCESS_BYTES}
        extra = {}
    return {"status": "pass", "child_rss": rss, "measured": readings, "preflight_estimates": estimates,
            "ratio_measured_over_estimate": {k: readings[k] / estimates[k] for k in estimates}, **extra}
