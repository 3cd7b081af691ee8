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
distribution (raw logprobs there would differ by the temperature alone). The last run puts fp32 heads on both
sides of the bf16 pair (engine.fp32_lm_head, trainer.fp32_lm_head: fp32 logits from the bf16 hidden states and
weight); every row also gives its cost, measured in the same run: the engine's answer tokens a second and the
trainer's scored tokens a second (after a short untimed pass), and the heads' memory from the model's shape
(head_memory). Writes JSON and a PNG of the ratio's distribution per row.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Run:
    engine_dtype: str
    mixed_precision: bool  # the trainer's bf16 compute (trainer.mixed_precision)
    fp32_heads: bool = False  # engine.fp32_lm_head and trainer.fp32_lm_head
    batch_invariant: bool = False  # engine.batch_invariant
    native_rotary: bool = False  # engine.native_rotary

    def runtime(self, cfg: JobConfig) -> Runtime:
        """The run's runtime, its job checked as `colocate launch` checks it: a ConfigError (batch invariance or a
        bf16 trainer where the platform lacks it) comes here, in one line, before anything starts."""
        from colocate.job.setup import check_job, set_up_job

        job = self.job(cfg)
        setup = set_up_job(job, check_job(job))
        return Runtime(setup.config, setup)

    def job(self, cfg: JobConfig) -> JobConfig:
        return dataclasses.replace(
            cfg, engine=dataclasses.replace(cfg.engine, dtype=self.engine_dtype, fp32_lm_head=self.fp32_heads,
                                            batch_invariant=self.batch_invariant, native_rotary=self.native_rotary),
            trainer=dataclasses.replace(cfg.trainer, mixed_precision=self.mixed_precision,
                                        fp32_lm_head=self.fp32_heads))


def runtimes(runs, cfg: JobConfig, skipped: list[dict]) -> Iterator[tuple[Run, Runtime]]:
    """Each run's runtime in turn (the caller enters it); a run its checks refuse (batch invariance or a bf16
    trainer where the platform lacks it) is skipped, its one line in `skipped` and printed."""
    for run in runs:
        try:
            yield run, run.runtime(cfg)
        except ConfigError as e:
            skipped.append({**dataclasses.asdict(run), "why": str(e)})
            print(f"skipped: {run}: {e}")


RUNS = (Run("float32", False), Run("bfloat16", False), Run("bfloat16", True), Run("bfloat16", True, True))
SAMPLING = {"float32": ((1.0, 1.0),), "bfloat16": ((1.0, 1.0), (0.7, 0.9))}  # (temperature, top_p) per engine dtype
BAND = 1.1
WARMUP_TOKENS = 8


def run_mismatch_bench(cfg: JobConfig, *, num_prompts: int, num_samples: int, max_tokens: int, out_dir: str,
                       name: str) -> dict:
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    samples = PromptStream(task, seed=cfg.rollout.seed).next_batch(num_prompts)
    rows, ratios, skipped = [], {}, []
    for run, runtime in runtimes(RUNS, cfg, skipped):
        with runtime as rt:
            job = rt.cfg
            trainer_dtype = rt.trainer_info[0]["compute_dtype"]
            prompts = [rt.tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples]
            budget = min(max_tokens, job.engine.max_model_len - max(map(len, prompts)) - 1)
            _measure(rt, prompts[:2], 1, WARMUP_TOKENS, 1.0, 1.0, cfg.engine.seed)  # first steps, not timed
            memory = head_memory(job, run, device=rt.plan.device)
            for temperature, top_p in SAMPLING[run.engine_dtype]:
                label = f"{run.engine_dtype} engine, {trainer_dtype} trainer{', fp32 heads' * run.fp32_heads}, " \
                        f"T={temperature:g}, top_p={top_p:g}"
                log_w, seq_log_w, speed = _measure(rt, prompts, num_samples, budget, temperature, top_p,
                                                   cfg.engine.seed)
                ratios[label] = np.exp(log_w.numpy())
                rows.append({"engine_dtype": run.engine_dtype, "trainer_dtype": trainer_dtype,
                             "fp32_heads": run.fp32_heads, "trainer_logits_dtype": rt.trainer_info[0]["logits_dtype"],
                             "engine_logits_dtype": rt.engine_info[0]["logits_dtype"],
                             "temperature": temperature, "top_p": top_p, "max_tokens": budget, **speed,
                             "memory": memory,
                             **mismatch_stats(log_w, seq_log_w, band=BAND)})
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "engine_tp": cfg.engine.tp,
                         "num_prompts": num_prompts, "num_samples": num_samples,
                         "logprobs_mode": "processed_logprobs", "enforce_eager": cfg.engine.enforce_eager},
              "rows": rows, **({"skipped": skipped} if skipped else {})}
    path = write_result(result, out_dir, name)
    _plot(ratios, Path(out_dir) / f"{name}.png")
    _print(rows, path)
    return result


def head_memory(job: JobConfig, run: Run, *, device: str) -> dict[str, int]:
    """What the heads hold, in bytes, from the model's shape: the engine's fp32 copy of its lm_head shard, made
    for each forward on the CPU (vLLM's `_apply_head` cast path; CUDA's GEMM with fp32 output makes none), and one
    trainer rank's train-step peak as the preflight predicts it (trainer/step_moments.py: within 8% of torch's
    MemTracker on a real step, tests/distributed/test_step_moments.py)."""
    from colocate.job.train_peaks import predict_train_peaks
    from colocate.models.dims import model_dims

    dims = model_dims(job)
    peaks = predict_train_peaks(job, dims, device=device)
    head = dims.vocab_size * dims.hidden_size
    copy = run.fp32_heads and device == "cpu"
    return {"engine_head_copy_bytes": 4 * head // job.engine.tp if copy else 0,
            "trainer_step_peak_bytes": peaks.resident_bytes + peaks.forward_backward_bytes}


def _measure(rt: Runtime, prompts: list[list[int]], num_samples: int, max_tokens: int, temperature: float,
             top_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Sample on every engine, rescore every sampled token on the trainers: (per-token log w, per-seq sum, the
    engine's and the trainer's tokens a second)."""
    start = time.perf_counter()
    seqs = sample(rt, prompts, {"n": num_samples, "temperature": temperature, "top_p": top_p,
                                "max_tokens": max_tokens, "seed": seed})
    generate_s, start = time.perf_counter() - start, time.perf_counter()
    scored = score(rt, seqs, temperature=temperature, top_p=top_p)
    score_s = time.perf_counter() - start
    answer_tokens = sum(len(s.response_ids) for s in seqs)
    speed = {"engine_tokens_per_s": answer_tokens / generate_s,
             "trainer_tokens_per_s": sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs) / score_s}
    token_log_w = [torch.tensor(trainer, dtype=torch.float64) - torch.tensor(seq.logprobs, dtype=torch.float64)
                   for seq, trainer in zip(seqs, scored)]
    return torch.cat(token_log_w), torch.stack([delta.sum() for delta in token_log_w]), speed


def sample(rt: Runtime, prompts: list[list[int]], sampling: dict) -> list[Sequence]:
    """Every prompt's answers (EngineActor.generate's `sampling`), the prompts dealt to the engines in turn; the
    answers in prompt order, an empty one dropped. Each answer's logprobs are the engine's sampling log-probs."""
    num_engines = len(rt.engines)
    outputs = ray.get([e.generate.remote(prompts[i::num_engines], sampling) for i, e in enumerate(rt.engines)])
    seqs = []
    for index, prompt in enumerate(prompts):
        group = outputs[index % num_engines][index // num_engines]
        seqs += [Sequence(prompt, c["token_ids"], c["logprobs"], 0.0, routing=c.get("routing"))
                 for c in group if c["token_ids"]]
    return seqs


def score(rt: Runtime, seqs: list[Sequence], *, temperature: float = 1.0, top_p: float = 1.0,
          method: str = "score") -> list:
    """The trainer's log-probs of each sequence's answer (TrainerActor.score, the loss's path), dealt to the ranks
    as a train step deals them (TrainerGroup.score). `method` score_routing: each with the trainer's own routing
    (algo.router_replay)."""
    return rt.trainers.score(seqs, rt.cfg.trainer, temperature=temperature, top_p=top_p, method=method)


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
    print(f"{'engine, trainer':<64} {'tokens':>7} {'mean |dlogp|':>13} {'max |dlogp|':>12} {'ratio range':>17} "
          f"{'outside x1.1':>13} {'engine tok/s':>13} {'trainer tok/s':>14}")
    for r in rows:
        t = r["token"]
        label = (f"{r['engine_dtype']} engine, {r['trainer_dtype']} trainer{', fp32 heads' * r['fp32_heads']}, "
                 f"T={r['temperature']:g}, top_p={r['top_p']:g}")
        print(f"{label:<64} {t['count']:>7} {t['mean_abs_log_ratio']:>13.2e} {t['max_abs_log_ratio']:>12.2e} "
              f"[{t['ratio_min']:.3f}, {t['ratio_max']:.3f}] {t['fraction_outside_band']:>12.2%} "
              f"{r['engine_tokens_per_s']:>13.1f} {r['trainer_tokens_per_s']:>14.1f}")
    print(f"results: {path} (+ .png)")
