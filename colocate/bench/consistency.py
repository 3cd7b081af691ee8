"""`colocate bench consistency`: where the engine's log-probs and the trainer's first differ, and whether either
depends on what else is in its batch. The rollout chapter's second problem, taken apart.

    colocate bench consistency                     # the bench preset, TP=1 and one trainer rank, 120-token answers

The engine samples answers at T=1; then every response token gets five log-probs, each of the same token at the
same position under the same weights:
  decode          the engine's sampling log-prob: token by token, from its KV cache (the first answer token's from
                  the prompt's prefill)
  prefill         the engine's, for the whole sequence given as a prompt: one prefill pass (vLLM prompt_logprobs),
                  in one batch with every other sequence
  prefill_alone   the same, the sequence alone
  trainer         the trainer's recompute (TrainerActor.score, the loss's path), in micro-batches of others
  trainer_alone   the same, the sequence alone
and five comparisons say where the difference comes from: decode/prefill (the engine against itself: a KV cache
and decode kernels against one prefill), decode_alone/prefill (the same for answers sampled one prompt at a time
with one sample: every decode step a batch of one row, as a rollout's long tail decodes), prefill/trainer
(vLLM's CPU kernels against torch's: the mismatch the loss sees, less the decode's share), prefill/prefill_alone
and trainer/trainer_alone (batch invariance: bit-equal or not). Each gives the share of tokens whose two
log-probs are bit-equal, at the first answer token and after it, and mean and max |difference|. Runs: fp32 on
both sides (where equal bits could be had), bf16 with fp32 heads, each again with engine.native_rotary (the
engine's rotary in torch, the trainer's arithmetic) and with engine.batch_invariant (refused on the CPU: the
result keeps that line). Any trainer world size: the ranks score in turn.

vLLM 0.32's batch-invariant mode (engine.batch_invariant) has no CPU kernels: on the CPU this measures what the
default kernels do; with a GPU the same bench runs with engine.batch_invariant=true.
"""

from __future__ import annotations

import statistics
import time

import ray
import torch

from colocate.bench.common import write_result
from colocate.bench.mismatch import Run, runtimes, sample, score
from colocate.config import JobConfig
from colocate.job.runtime import Runtime
from colocate.rl.samples import Sequence
from colocate.rl.tasks import PromptStream, make_task

# the batch-invariant runs are refused where vLLM has no such kernels (the CPU): their line is in the result
RUNS = (Run("float32", False), Run("float32", False, native_rotary=True), Run("bfloat16", True, True),
        Run("bfloat16", True, True, native_rotary=True), Run("float32", False, batch_invariant=True),
        Run("bfloat16", True, True, batch_invariant=True))
PAIRS = (("decode", "prefill"), ("prefill", "trainer"), ("prefill", "prefill_alone"), ("trainer", "trainer_alone"))


def run_consistency_bench(cfg: JobConfig, *, num_prompts: int, num_samples: int, max_tokens: int, out_dir: str,
                          name: str) -> dict:
    task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
    samples = PromptStream(task, seed=cfg.rollout.seed).next_batch(num_prompts)
    rows, skipped = [], []
    for run, runtime in runtimes(RUNS, cfg, skipped):
        with runtime as rt:
            job = rt.cfg
            prompts = [rt.tokenizer(s.prompt, add_special_tokens=False).input_ids for s in samples]
            budget = min(max_tokens, job.engine.max_model_len - max(map(len, prompts)) - 1)
            _sample(rt, prompts[:2], 1, 8, job.engine.seed)  # the first steps, untimed
            start = time.perf_counter()
            seqs = _sample(rt, prompts, num_samples, budget, job.engine.seed)
            sample_s, start = time.perf_counter() - start, time.perf_counter()
            trainer = score(rt, seqs)
            score_s = time.perf_counter() - start
            logprobs = {"decode": [s.logprobs for s in seqs], "prefill": _prefill(rt, seqs),
                        "prefill_alone": [_prefill(rt, [s])[0] for s in seqs], "trainer": trainer,
                        "trainer_alone": [score(rt, [s])[0] for s in seqs]}
            pairs = {f"{a}/{b}": compare(logprobs[a], logprobs[b]) for a, b in PAIRS}
            lone = [s for p in prompts for s in _sample(rt, [p], 1, budget, job.engine.seed)]
            pairs["decode_alone/prefill"] = compare([s.logprobs for s in lone], [_prefill(rt, [s])[0] for s in lone])
            answer_tokens = sum(len(s.response_ids) for s in seqs)
            rows.append({"engine_dtype": run.engine_dtype, "batch_invariant": run.batch_invariant,
                         "native_rotary": run.native_rotary,
                         "engine_tokens_per_s": answer_tokens / sample_s,
                         "trainer_tokens_per_s": (sum(len(s.prompt_ids) for s in seqs) + answer_tokens) / score_s,
                         "trainer_dtype": rt.trainer_info[0]["compute_dtype"],
                         "engine_logits_dtype": rt.engine_info[0]["logits_dtype"],
                         "trainer_logits_dtype": rt.trainer_info[0]["logits_dtype"],
                         "attention": rt.trainer_info[0]["attention"], "engine_tp": job.engine.tp,
                         "sequences": len(seqs), "max_tokens": budget,
                         "pairs": pairs})
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "num_prompts": num_prompts,
                         "num_samples": num_samples, "temperature": 1.0, "top_p": 1.0},
              "rows": rows, **({"skipped": skipped} if skipped else {})}
    path = write_result(result, out_dir, name)
    _print(rows)
    for r in rows:
        print(f"{r['engine_dtype']} engine{', batch-invariant' * r['batch_invariant']}"
              f"{', torch rotary' * r['native_rotary']}: "
              f"{r['engine_tokens_per_s']:.1f} answer tokens/s sampled, "
              f"{r['trainer_tokens_per_s']:.1f} tokens/s scored")
    for s in skipped:
        print(f"skipped: {s['engine_dtype']} engine{', batch-invariant' * s['batch_invariant']}: {s['why']}")
    print(f"results: {path}")
    return result


def _sample(rt: Runtime, prompts: list[list[int]], num_samples: int, max_tokens: int, seed: int) -> list[Sequence]:
    return sample(rt, prompts, {"n": num_samples, "temperature": 1.0, "top_p": 1.0, "max_tokens": max_tokens,
                                "seed": seed})


def _prefill(rt: Runtime, seqs: list[Sequence]) -> list[list[float]]:
    """Each sequence's answer-token log-probs from one prefill pass over prompt + answer, all in one call."""
    sampling = {"n": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens": 1, "prompt_logprobs": True}
    whole = [s.prompt_ids + s.response_ids for s in seqs]
    out = ray.get(rt.engines[0].generate.remote(whole, sampling))
    # prompt_logprobs start at the second token: the answer's first is at len(prompt) - 1
    return [group[0]["prompt_logprobs"][len(s.prompt_ids) - 1:] for s, group in zip(seqs, out)]


def compare(a: list[list[float]], b: list[list[float]]) -> dict:
    """Per-token comparison of two log-probs of the same tokens (one list per sequence): the share bit-equal, at
    the first answer token and after it, the median position of a sequence's first difference, mean and max
    |a - b|."""
    first, later, firsts, diffs = [], [], [], []
    for x, y in zip(a, b):
        assert len(x) == len(y), (len(x), len(y))
        dx = (torch.tensor(x, dtype=torch.float64) - torch.tensor(y, dtype=torch.float64)).abs()
        equal = dx == 0
        first.append(bool(equal[0]))
        later += equal[1:].tolist()
        unequal = (~equal).nonzero()
        firsts.append(int(unequal[0]) if len(unequal) else len(x))
        diffs.append(dx)
    d = torch.cat(diffs)
    return {"tokens": d.numel(), "bit_equal": float((d == 0).double().mean()),
            "bit_equal_first_token": sum(first) / len(first),
            "bit_equal_after": sum(later) / len(later) if later else None,
            "first_difference_position_median": statistics.median(firsts),
            "mean_abs": float(d.mean()), "max_abs": float(d.max())}


def _print(rows: list[dict]) -> None:
    print(f"{'run':<62} {'pair':<26} {'bit-equal':>9} {'first tok':>9} {'after':>7} {'mean |d|':>9} {'max |d|':>9}")
    for r in rows:
        run = f"{r['engine_dtype']} engine ({r['engine_logits_dtype']} logits" \
              f"{', batch-invariant' * r['batch_invariant']}{', torch rotary' * r['native_rotary']}), " \
              f"{r['trainer_dtype']} trainer"
        for pair, c in r["pairs"].items():
            after = f"{c['bit_equal_after']:.1%}" if c["bit_equal_after"] is not None else "-"
            print(f"{run:<62} {pair:<26} {c['bit_equal']:>9.1%} {c['bit_equal_first_token']:>9.1%} {after:>7} "
                  f"{c['mean_abs']:>9.2e} {c['max_abs']:>9.2e}")
