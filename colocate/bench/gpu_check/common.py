"""What every section of the one-GPU check shares: the device's clocks and free memory, its results' shape, and
the child processes sections run in.

Children come from one forkserver that imported torch, transformers and the trainer once: a section that needs a
fresh process (a process group of its own, a clean CUDA context to measure, a trainer rank attaching the ring)
forks from it in well under a second instead of importing again (about 10 s on the 2-core CI machine). The
server only imports: importing torch touches no device, so forking it is safe on CUDA too (the same reason as
tests/distributed/conftest.py). Hazard: the server is started by the first child and keeps the `sys.path` of
that moment (multiprocessing passes it), so the torch_memory_saver wheel must be unpacked onto `sys.path` before
(run.py does it first).
"""

from __future__ import annotations

import queue
import socket
import statistics
import time
import traceback

import torch
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "transformers",
           "transformers.models.qwen2.modeling_qwen2", "colocate.trainer.actor", "colocate.sync.gather",
           "colocate.bench.gpu_check.common"]
_CONTEXT = None


def context():
    """The forkserver context every section's children come from (started at the first child)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes() -> int:
    """The driver's free device memory (cudaMemGetInfo), after the device's queued work."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def elapsed(fn, device: torch.device) -> float:
    """Seconds `fn`'s work takes: CUDA events around it on the GPU, the wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, device: torch.device, *, reps: int = 3) -> float:
    """The floor: best of `reps` plain copies (a cast when the dtypes differ) of the same bytes, after a warm-up
    (the first kernel of a kind in a process pays for loading it: 13-50 ms on the H200)."""
    dst.copy_(src)
    sync(device)
    return min(elapsed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(reps))


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b x over (x, y) points: a per-call cost and a per-byte cost."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return statistics.mean(ys), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def failure() -> dict:
    """The section result of the exception being handled: its last line and the traceback's tail."""
    text = traceback.format_exc()
    return {"status": "fail", "error": text.strip().splitlines()[-1], "traceback": text[-6000:]}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def _child_entry(fn, args, results) -> None:
    try:
        results.put(("ok", fn(*args)))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def run_child(fn, *args, timeout: float = 300):
    """`fn(*args)` in a fresh process forked from the preloaded server; its return value (picklable), or a
    RuntimeError carrying the child's traceback."""
    ctx = context()
    results = ctx.Queue()
    proc = ctx.Process(target=_child_entry, args=(fn, args, results))
    proc.start()
    try:
        kind, payload = receive(results, [proc], timeout)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    if kind == "error":
        raise RuntimeError(f"the child process failed:\n{payload}")
    return payload


def receive(results, procs, timeout: float):
    """The next message on `results`; raises when a child died without one or nothing came in `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a child process died without reporting (exit codes {dead})") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no message from the children in {timeout} s") from None
