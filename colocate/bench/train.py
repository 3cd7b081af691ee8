"""`colocate bench train`: trainer tokens/s and peak memory per rank, today's path beside each long-answer
feature and all of them together, at answer lengths from 128 to 4,096 tokens.

    colocate bench train                                   # bench preset, answers 128 .. 4096
    colocate bench train --lengths 128,512 model.preset=tiny

Each variant runs in a process of its own: one real trainer rank (TrainerActor, FSDP2 on gloo, world size 1, the
GRPO loss), set up with the variant's keys. A first step creates AdamW's state; then for each length one step
trains a long-tailed group of answers (L, L/4, L/4 and L/8 tokens after 64-token prompts, the shape a reasoning
model's answers have) and is measured as train-memory measures (bench/train_memory.py): the step's own memory is
its peak RSS over the RSS before it, beside the prediction for the micro-batches that step runs (the largest of
`preflight.micro_batch_bytes` over them, with the gradients from the second on) and the preflight's bound for the
variant's config (the gradients plus its largest possible micro-batch). Tokens/s counts real tokens, not padding.

    today         padded rows of one (the only size that fits long answers today), full logits, every activation
    chunked       trainer.logprob_chunk_tokens=512
    checkpointed  trainer.activation_checkpointing=true
    packed        trainer.pack_sequences=true under a budget of the longest sequence (short answers share a pass)
    bf16          trainer.mixed_precision=true, only where the CPU computes bf16 natively (AVX-512 BF16 or AMX)
    all           every one of the above together
    all_fp32      all of them but bf16, where the CPU has bf16: the fp32-only figures beside

Ratios are taken within the run: each variant's tokens/s and step memory over today's at the same length.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
from pathlib import Path

from colocate.bench.common import machine, write_result
from colocate.bench.train_memory import TOLERANCE, measured_readings, peak_rss_bytes, reset_peak_rss
from colocate.config import JobConfig
from colocate.host.devices import cpu_bf16_features
from colocate.host.memory import process_rss_bytes, return_free_memory_to_os
from colocate.rl.samples import Sequence

PROMPT = 64
DEFAULT_LENGTHS = (128, 512, 1024, 2048, 4096)
CHUNK_TOKENS = 512  # 512 x 32,768 vocabulary x 16 bytes: 0.25 GiB at the peak
MEMORY_TARGET = 4.0  # all features at the longest answers: at least 4x less step memory than today's path


def variants(bf16: bool) -> dict[str, dict]:
    """Each variant's trainer keys; `None` budget: the longest sequence of the length measured."""
    today = {"micro_batch_size": 1, "logprob_chunk_tokens": None, "activation_checkpointing": False,
             "pack_sequences": False, "max_tokens_per_micro_batch": None, "mixed_precision": False}
    out = {"today": today,
           "chunked": {**today, "logprob_chunk_tokens": CHUNK_TOKENS},
           "checkpointed": {**today, "activation_checkpointing": True},
           "packed": {**today, "pack_sequences": True, "max_tokens_per_micro_batch": "longest"}}
    if bf16:
        out["bf16"] = {**today, "mixed_precision": True}
    out["all"] = {**today, "logprob_chunk_tokens": CHUNK_TOKENS, "activation_checkpointing": True,
                  "pack_sequences": True, "max_tokens_per_micro_batch": "longest", "mixed_precision": bf16}
    if bf16:
        out["all_fp32"] = {**out["all"], "mixed_precision": False}
    return out


def answer_lengths(length: int) -> list[int]:
    return [length, max(1, length // 4), max(1, length // 4), max(1, length // 8)]


def _trainer_keys(keys: dict, length: int) -> dict:
    budget = PROMPT + length if keys["max_tokens_per_micro_batch"] == "longest" else keys["max_tokens_per_micro_batch"]
    return {**keys, "max_tokens_per_micro_batch": budget}


def _job_for(cfg: JobConfig, keys: dict, length: int) -> JobConfig:
    """The job whose preflight pictures this step: answers of at most `length` after a PROMPT-token prompt."""
    return dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, **_trainer_keys(keys, length)),
        rollout=dataclasses.replace(cfg.rollout, max_tokens=length),
        data=dataclasses.replace(cfg.data, max_prompt_tokens=PROMPT),
        engine=dataclasses.replace(cfg.engine, max_model_len=max(cfg.engine.max_model_len, PROMPT + length), tp=1),
        placement=dataclasses.replace(cfg.placement, num_slots=1, engine_slots=0))  # the one rank measured


def _sequences(length: int, vocab: int) -> list[Sequence]:
    return [Sequence([5 + (i + k) % (vocab - 5) for i in range(PROMPT)],
                     [6 + (i * 7 + k) % (vocab - 6) for i in range(n)], [-2.0] * n, 1.0 if k % 2 == 0 else -1.0)
            for k, n in enumerate(answer_lengths(length))]


def step_shapes(job: JobConfig, vocab: int, length: int) -> list[tuple[int, int, bool]]:
    """(rows, tokens per row, mask materialised) of each micro-batch the measured step runs, in the order it
    runs them (the longest first). The prediction is the largest of these; the preflight's bound
    (train_micro_batch_shape) assumes the worst the config allows, e.g. a packed row of several sequences filling
    the budget, where this step's longest answer is alone in its row."""
    from colocate.trainer.batching import sequence_tokens, trainer_micro_batches

    shapes = []
    for group in trainer_micro_batches(_sequences(length, vocab), job.trainer):
        lengths = [sequence_tokens(s) for s in group]
        several = len(group) > 1  # packed: the sequences' boundaries; padded: the padding (batching.py)
        shapes.append((1, sum(lengths), several) if job.trainer.pack_sequences else
                      (len(group), max(lengths), several))
    return shapes


def _measure(cfg: JobConfig, keys: dict, model_path: str, lengths: list[int], port: int, queue) -> None:
    """In a fresh process: one rank set up with the variant's keys, one measured step per length."""
    import torch

    from colocate.trainer.actor import TrainerActor
    from colocate.trainer.batching import trainer_micro_batches

    torch.manual_seed(0)
    # both cores: one rank alone on the machine (the default, one intra-op thread, is for ranks sharing it)
    trainer_cfg = dataclasses.replace(cfg.trainer, num_threads=len(os.sched_getaffinity(0)),
                                      **_trainer_keys(keys, lengths[-1]))
    trainer = TrainerActor(0, 1, trainer_cfg, model_path, device="cpu", pad_id=0, algo=cfg.algo,
                           sampling=cfg.rollout)
    info = trainer.setup("127.0.0.1", port)
    vocab = trainer.model.config.vocab_size
    warm = _sequences(lengths[0], vocab)[:1]
    trainer.train_step(warm, step=0, num_tokens_all_ranks=len(warm[0].response_ids), num_micro_batches=1,
                       num_seqs_all_ranks=1)
    for length in lengths:
        # the budget follows the length measured: a variant's micro-batches as a job of these answers has them
        trainer.cfg = dataclasses.replace(trainer_cfg, **_trainer_keys(keys, length))
        seqs = _sequences(length, vocab)
        groups = trainer_micro_batches(seqs, trainer.cfg)
        trainer.release_grads()
        gc.collect()
        return_free_memory_to_os()
        before = process_rss_bytes()
        reset_peak_rss()
        started = time.perf_counter()
        trainer.train_step(seqs, step=0, num_tokens_all_ranks=sum(len(s.response_ids) for s in seqs),
                           num_micro_batches=len(groups), num_seqs_all_ranks=len(seqs))
        step_s = time.perf_counter() - started
        queue.put({"length": length, "num_micro_batches": len(groups), "step_s": step_s,
                   "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs),
                   "rss_before_bytes": before, "peak_rss_bytes": peak_rss_bytes(), "attention": info["attention"]})
    trainer.shutdown()
    queue.put(None)


def _run_variant(cfg: JobConfig, keys: dict, model_path: str, lengths: list[int]) -> list[dict]:
    return list(measured_readings(_measure, cfg, keys, model_path, lengths))


def run_train_bench(cfg: JobConfig, *, lengths: list[int], out_dir: str, name: str,
                    only: list[str] | None = None) -> dict:
    from colocate.job.preflight import micro_batch_bytes, model_dims
    from colocate.models.sources import ensure_model

    assert lengths == sorted(lengths) and lengths, "lengths ascending"
    model_path = ensure_model(cfg.model)
    dims = model_dims(cfg)
    features = cpu_bf16_features()
    rows = []
    chosen = {v: keys for v, keys in variants(bf16=bool(features)).items() if only is None or v in only}
    for variant, keys in chosen.items():
        for reading in _run_variant(cfg, keys, model_path, lengths):
            job = _job_for(cfg, keys, reading["length"])
            # train_step sets the gradients to None first: the first micro-batch's backward allocates them while
            # it frees its activations, so only the micro-batches after it carry them whole (accumulating)
            steps = [micro_batch_bytes(job, dims, shape=shape, accumulating=bool(i))
                     for i, shape in enumerate(step_shapes(job, dims.vocab_size, reading["length"]))]
            parts = max(steps, key=lambda p: sum(p.values()))
            bound = sum(micro_batch_bytes(job, dims, accumulating=True).values())
            measured = reading["peak_rss_bytes"] - reading["rss_before_bytes"]
            predicted = sum(parts.values())
            row = {"variant": variant, **reading, "tokens_per_s": reading["tokens"] / reading["step_s"],
                   "measured_step_bytes": measured, "predicted_step_bytes": predicted, "predicted_parts": parts,
                   "preflight_bound_bytes": bound,
                   "prediction_ratio": measured / predicted,
                   "within_tolerance": abs(measured / predicted - 1) <= TOLERANCE}
            rows.append(row)
            print(f"{variant:<13} answer {row['length']:>5}  {row['tokens_per_s']:7.1f} tokens/s  step memory "
                  f"{measured / 2**30:6.2f} GiB (predicted {predicted / 2**30:6.2f}, ratio "
                  f"{row['prediction_ratio']:.3f})  peak RSS {row['peak_rss_bytes'] / 2**30:6.2f} GiB", flush=True)
    today = {r["length"]: r for r in rows if r["variant"] == "today"}
    for row in rows:
        base = today[row["length"]]
        row["speed_vs_today"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["memory_vs_today"] = base["measured_step_bytes"] / max(row["measured_step_bytes"], 1)
    longest = next((r for r in rows if r["variant"] == "all" and r["length"] == lengths[-1]), None)
    result = {"bench": "train", "model": dataclasses.asdict(dims), "lengths": lengths, "prompt_tokens": PROMPT,
              "answers_per_step": "L, L/4, L/4, L/8", "cpu_bf16_features": features,
              "variants": chosen, "tolerance": TOLERANCE, "rows": rows,
              "all_within_tolerance": all(r["within_tolerance"] for r in rows)}
    if longest is not None:  # "all" was run (--variants may leave it out)
        result.update(all_memory_vs_today_at_longest=longest["memory_vs_today"],
                      memory_target_met=longest["memory_vs_today"] >= MEMORY_TARGET)
    if not features:
        result["bf16_note"] = ("this CPU has neither AVX-512 BF16 nor AMX: bf16 would be emulated, and "
                               "trainer.mixed_precision is refused on it; every figure here is fp32")
    path = write_result(result, out_dir, name)
    plot(result, path.with_suffix(".png"))
    if longest is not None:
        print(f"all features at {lengths[-1]}-token answers: {longest['memory_vs_today']:.1f}x less step memory, "
              f"{longest['speed_vs_today']:.2f}x the tokens/s of today's path")
    print(f"{sum(r['within_tolerance'] for r in rows)}/{len(rows)} predictions within {TOLERANCE:.0%}; {path}")
    print(json.dumps({"memory_target_met": result.get("memory_target_met"),
                      "all_within_tolerance": result["all_within_tolerance"]}))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 4.5))
    for variant in result["variants"]:
        rows = [r for r in result["rows"] if r["variant"] == variant]
        lengths = [r["length"] for r in rows]
        speed.plot(lengths, [r["tokens_per_s"] for r in rows], marker="o", label=variant)
        line, = memory.plot(lengths, [r["measured_step_bytes"] / 2**30 for r in rows], marker="o", label=variant)
        memory.plot(lengths, [r["predicted_step_bytes"] / 2**30 for r in rows], linestyle=":",
                    color=line.get_color())
    for ax, title in ((speed, "trainer tokens/s (one rank)"), (memory, "step memory, GiB (dotted: predicted)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("longest answer, tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    memory.set_yscale("log")
    speed.legend(fontsize=8)
    host = machine()
    ratio = result.get("all_memory_vs_today_at_longest")
    fig.suptitle(f"colocate bench train: {host['cpu']}, {host['cores']} cores"
                 + (f"; all features at {result['lengths'][-1]}: {ratio:.1f}x less memory" if ratio else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
