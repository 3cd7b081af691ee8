"""The preflight's train-step memory held against a real train step's measured peak, at several lengths.

    colocate bench train-memory                                   # bench preset, lengths 256 .. 2048, ~4 min
    colocate bench train-memory --lengths 512,1024,2048,4096 model.preset=tiny

One trainer rank (the real TrainerActor: FSDP2 on gloo, world size 1, the GRPO loss) in a process of its own.
A first step creates AdamW's state; then, for each length, the gradients are released and the heap trimmed, the
process's peak RSS is reset (`/proc/self/clear_refs` 5 resets VmHWM), one step runs on sequences of exactly that
many tokens (a 64-token prompt and the rest answer, as the preflight assumes), and the peak is read.

The step's own memory, measured: peak RSS during the step (forward, backward and AdamW's step) less RSS before
it. Predicted: `preflight.predict_train_peaks` for a config whose one micro-batch is that step (world size 1,
answers that long): the larger of its forward+backward peak and its optimizer step's, each over the resident
state, with the parts of the moment that peaks (trainer/step_moments.py). Each row's ratio is measured /
predicted, side by side in one run; the judgment is |ratio - 1| <= 15%.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing as mp
import socket
import time

from colocate.bench.common import write_result
from colocate.config import JobConfig
from colocate.host.memory import process_rss_bytes, return_free_memory_to_os
from colocate.job.preflight import PROMPT_TOKENS  # the rows the preflight pictures: a 64-token prompt, then the answer
from colocate.rl.samples import Sequence

TOLERANCE = 0.15
DEFAULT_LENGTHS = (256, 512, 1024, 2048)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Documentation/filesystems/proc.rst: "5" resets the peak RSS (VmHWM) to the current RSS


def cases(cfg: JobConfig, lengths: list[int]) -> list[tuple[int, int, float]]:
    """(length, micro-batch rows, top_p) of each measured step: every length one row at the config's top_p,
    then the longest with two rows of unequal length (padding, the attention mask) and the longest with a
    nucleus (top_p 0.9) when the config has none."""
    out = [(length, 1, cfg.rollout.top_p) for length in lengths]
    out.append((lengths[-1], 2, cfg.rollout.top_p))
    if cfg.rollout.top_p >= 1.0:
        out.append((lengths[-1], 1, 0.9))
    return out


def _config_for(cfg: JobConfig, length: int, rows: int, top_p: float) -> JobConfig:
    """The job whose step is the measured one: one rank, one micro-batch of `rows` sequences of `length`."""
    return dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=rows),
        rollout=dataclasses.replace(cfg.rollout, max_tokens=length - PROMPT_TOKENS, top_p=top_p, num_prompts=1,
                                    num_samples=rows),
        engine=dataclasses.replace(cfg.engine, max_model_len=max(cfg.engine.max_model_len, length), tp=1),
        placement=dataclasses.replace(cfg.placement, num_slots=1, engine_slots=0))


def _sequences(length: int, rows: int, vocab: int) -> list[Sequence]:
    """`rows` sequences; the first exactly `length` tokens, the others shorter (padded up to it)."""
    out = []
    for row in range(rows):
        response = length - PROMPT_TOKENS - row * (length // 4)
        out.append(Sequence([5 + i % (vocab - 5) for i in range(PROMPT_TOKENS)],
                            [6 + (i * 7) % (vocab - 6) for i in range(response)], [-2.0] * response,
                            1.0 if row % 2 == 0 else -1.0))
    return out


def _measure(cfg: JobConfig, model_path: str, runs: list[tuple[int, int, float]], port: int, queue) -> None:
    """In a fresh process: one rank's steps, each one's peak over the RSS before it."""
    import torch

    from colocate.trainer.actor import TrainerActor

    torch.manual_seed(0)
    trainer = TrainerActor(0, 1, cfg.trainer, model_path, device="cpu", pad_id=0, algo=cfg.algo,
                           sampling=cfg.rollout)
    trainer.setup("127.0.0.1", port)
    vocab = trainer.model.config.vocab_size
    warm = _sequences(runs[0][0], 1, vocab)
    trainer.train_step(warm, step=0, num_tokens_all_ranks=len(warm[0].response_ids), num_micro_batches=1,
                       num_seqs_all_ranks=1)
    for length, rows, top_p in runs:
        trainer.sampling = dataclasses.replace(trainer.sampling, top_p=top_p)
        trainer.release_grads()
        gc.collect()
        return_free_memory_to_os()
        before = process_rss_bytes()
        reset_peak_rss()
        seqs = _sequences(length, rows, vocab)
        started = time.perf_counter()
        trainer.train_step(seqs, step=0, num_tokens_all_ranks=sum(len(s.response_ids) for s in seqs),
                           num_micro_batches=1,
                           num_seqs_all_ranks=len(seqs))
        queue.put({"length": length, "rows": rows, "top_p": top_p, "rss_before_bytes": before,
                   "peak_rss_bytes": peak_rss_bytes(), "step_s": time.perf_counter() - started})
    trainer.shutdown()
    queue.put(None)


def _next_reading(queue, worker) -> dict | None:
    import queue as queues

    while True:
        try:
            return queue.get(timeout=5)
        except queues.Empty:
            if not worker.is_alive():
                raise RuntimeError(f"the measuring process died (exit code {worker.exitcode}; -9: killed, e.g. out "
                                   "of memory): use shorter --lengths or a smaller model") from None


def measured_readings(target, *args):
    """`target(*args, port, queue)` in a fresh daemon process (it goes with this one on Ctrl-C, never left to compete
    for the memory it measures): each reading it puts on the queue, until it puts None; then it must exit 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=target, args=(*args, port, queue), daemon=True)
    worker.start()
    while (reading := _next_reading(queue, worker)) is not None:
        yield reading
    worker.join()
    assert worker.exitcode == 0, f"the measuring process exited with {worker.exitcode}"


def run_train_memory_bench(cfg: JobConfig, *, lengths: list[int], out_dir: str, name: str) -> dict:
    from colocate.job.preflight import model_dims, predict_train_peaks
    from colocate.models.sources import ensure_model

    assert lengths == sorted(lengths) and lengths, "lengths ascending"
    model_path = ensure_model(cfg.model)
    dims = model_dims(cfg)
    runs = cases(cfg, lengths)
    rows = []
    for reading in measured_readings(_measure, cfg, model_path, runs):
        job = _config_for(cfg, reading["length"], reading["rows"], reading["top_p"])
        peaks = predict_train_peaks(job, dims, device="cpu")
        backward = peaks.forward_backward_bytes >= peaks.optimizer_step_bytes  # the larger of the step's two
        parts = peaks.forward_backward_parts if backward else peaks.optimizer_step_parts
        predicted = sum(parts.values())
        measured = reading["peak_rss_bytes"] - reading["rss_before_bytes"]
        row = {**reading, "tokens": reading["length"] * reading["rows"], "measured_step_bytes": measured,
               "predicted_step_bytes": predicted, "predicted_parts": parts,
               "predicted_moment": peaks.forward_backward_moment if backward else "optimizer step",
               "ratio": measured / predicted,
               "within_tolerance": abs(measured / predicted - 1) <= TOLERANCE}
        rows.append(row)
        print(f"length {row['length']:>6} x{row['rows']} top_p {row['top_p']:<4} measured "
              f"{measured / 2**30:6.2f} GiB  predicted {predicted / 2**30:6.2f} GiB  ratio {row['ratio']:.3f}"
              f"  ({row['step_s']:.1f} s)", flush=True)
    result = {"bench": "train-memory", "model": dataclasses.asdict(dims), "tolerance": TOLERANCE,
              "trainer": dataclasses.asdict(cfg.trainer), "rows": rows,
              "all_within_tolerance": all(r["within_tolerance"] for r in rows)}
    path = write_result(result, out_dir, name)
    print(f"{sum(r['within_tolerance'] for r in rows)}/{len(rows)} rows within {TOLERANCE:.0%}; {path}")
    print(json.dumps({"all_within_tolerance": result["all_within_tolerance"]}))
    return result
