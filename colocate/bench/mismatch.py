"""`colocate bench mismatch`: how far the engine's sampling logprobs are from the trainer's, per engine dtype and
trainer dtype.

    colocate bench mismatch                         # bench preset, 120-token answers, every pair in RUNS
    colocate bench mismatch configs/default.yaml

For each pair of engine dtype and trainer compute dtype in RUNS (a runtime of its own: the same checkpoint, so
engine and trainer hold the same weights; a bf16 trainer is FSDP2 mixed precision, trainer.mixed_precision) the
engine samples answers to the same prompts with the same seed and returns each sampled token's logprob
(processed: the distribution it sampled from); the trainer recomputes every one of those tokens in one pass, and
its dtype is the one the trainer reports it ran (TrainerActor.setup's compute_dtype), never assumed. This is the
rollout chapter's experiment (token-by-token sampling with a KV cache against one forward pass over the whole
sequence) run with colocate's own engine and trainer. Per token, log w = logp_trainer - logp_engine; the table
gives mean and max |log w|, the range and quantiles of the ratio w = p_trainer / p_engine, and the fraction of
tokens and sequences outside [1/1.1, 1.1].
A bf16 engine is also measured at temperature 0.7 and top-p 0.9, where both sides must score the processed
distribution (raw logprobs there would differ by the temperature alone). Writes JSON and a PNG of the ratio's
distribution per row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import ray
import torch

from colocate.bench.common import write_result
from colocate.config import JobConfig
from colocate.errors import ConfigError
from colocate.job.runtime import Runtime
from colocate.rl.corrections import mismatch_stats
from colocate.rl.samples import Sequence
from colocate.rl.tasks import PromptStream, make_task

RUNS = (("float32", False), ("bfloat16", False), ("bfloat16", True))  # (engine dtype, trainer mixed precision)
SAMPLING = {"float32": ((1.0, 1.0),), "bfloat16": ((1.0, 1.0), (0.7, 0.9))}  # (temperature, top_p) per engine dtype
BAND = 1.1


def run_mismatch_bench(cfg: JobConfig, *, num_prompts: int, num_samples: int, max_tokens: int, out_dir: str,
                       name: str) -> dict:
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    samples = PromptStream(task, seed=cfg.rollout.seed).next_batch(num_prompts)
    rows, ratios, skipped = [], {}, []
    for dtype, mixed in RUNS:
        job = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, dtype=dtype),
                                  trainer=dataclasses.replace(cfg.trainer, mixed_precision=mixed))
        try:
            runtime = Runtime(job)
        except ConfigError as e:  # a bf16 trainer on a CPU without native bf16: the placement's one line
            skipped.append({"engine_dtype": dtype, "trainer_mixed_precision": mixed, "why": str(e)})
            print(f"skipped: {dtype} engine with trainer.mixed_precision={mixed}: {e}")
            continue
        with runtime as rt:
            trainer_dtype = rt.trainer_info[0]["compute_dtype"]
            prompts = [rt.tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples]
            budget = min(max_tokens, job.engine.max_model_len - max(map(len, prompts)) - 1)
            for temperature, top_p in SAMPLING[dtype]:
                label = f"{dtype} engine, {trainer_dtype} trainer, T={temperature:g}, top_p={top_p:g}"
                log_w, seq_log_w = _measure(rt, prompts, num_samples, budget, temperature, top_p, cfg.engine.seed)
                ratios[label] = np.exp(log_w.numpy())
                rows.append({"engine_dtype": dtype, "trainer_dtype": trainer_dtype, "temperature": temperature,
                             "top_p": top_p, "max_tokens": budget, **mismatch_stats(log_w, seq_log_w, band=BAND)})
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "engine_tp": cfg.engine.tp,
                         "num_prompts": num_prompts, "num_samples": num_samples,
                         "logprobs_mode": "processed_logprobs", "enforce_eager": cfg.engine.enforce_eager},
              "rows": rows, **({"skipped": skipped} if skipped else {})}
    path = write_result(result, out_dir, name)
    _plot(ratios, Path(out_dir) / f"{name}.png")
    _print(rows, path)
    return result


def _measure(rt: Runtime, prompts: list[list[int]], num_samples: int, max_tokens: int, temperature: float,
             top_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample on every engine, rescore every sampled token on the trainers: (per-token log w, per-seq sum)."""
    sampling = {"n": num_samples, "temperature": temperature, "top_p": top_p, "max_tokens": max_tokens,
                "seed": seed}
    num_engines = len(rt.engines)
    outputs = ray.get([e.generate.remote(prompts[i::num_engines], sampling) for i, e in enumerate(rt.engines)])
    seqs = []
    for i, groups in enumerate(outputs):
        for prompt, group in zip(prompts[i::num_engines], groups):
            seqs += [Sequence(prompt, c["token_ids"], c["logprobs"], 0.0) for c in group if c["token_ids"]]
    world = len(rt.trainers)
    num_micro_batches = -(-(-(-len(seqs) // world)) // rt.cfg.trainer.micro_batch_size)
    scored = ray.get([t.score.remote(seqs[rank::world], num_micro_batches=num_micro_batches,
                                     temperature=temperature, top_p=top_p)
                      for rank, t in enumerate(rt.trainers)])
    token_log_w, seq_log_w = [], []
    for rank, per_rank in enumerate(scored):
        for seq, trainer in zip(seqs[rank::world], per_rank):
            delta = torch.tensor(trainer, dtype=torch.float64) - torch.tensor(seq.logprobs, dtype=torch.float64)
            token_log_w.append(delta)
            seq_log_w.append(delta.sum().reshape(1))
    return torch.cat(token_log_w), torch.cat(seq_log_w)


def _plot(ratios: dict[str, np.ndarray], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    low = min(float(r.min()) for r in ratios.values())
    high = max(float(r.max()) for r in ratios.values())
    bins = np.linspace(min(low, 1 / BAND), max(high, BAND), 121)
    for label, ratio in ratios.items():
        ax.hist(ratio, bins=bins, histtype="step", linewidth=1.5, label=f"{label} ({ratio.size} tokens)")
    for edge in (1 / BAND, BAND):
        ax.axvline(edge, color="grey", linestyle=":", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("p_trainer / p_engine per sampled token (dotted: the monitor's band)")
    ax.set_ylabel("tokens")
    ax.set_title("training/inference mismatch: trainer vs engine, same prompts and seed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print(rows: list[dict], path: Path) -> None:
    print(f"{'engine, trainer':<52} {'tokens':>7} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'ratio range':>17} "
          f"{'outside x1.1':>13}")
    for r in rows:
        t = r["token"]
        label = (f"{r['engine_dtype']} engine, {r['trainer_dtype']} trainer, T={r['temperature']:g}, "
                 f"top_p={r['top_p']:g}")
        print(f"{label:<52} {t['count']:>7} {t['mean_abs_log_ratio']:>13.2e} {t['max_abs_log_ratio']:>12.2e} "
              f"[{t['ratio_min']:.3f}, {t['ratio_max']:.3f}] {t['fraction_outside_band']:>12.2%}")
    print(f"results: {path} (+ .png)")
