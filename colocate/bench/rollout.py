"""`colocate bench rollout`: the long tail of rollout, and what partial rollout and over-sampling do about it.

    colocate bench rollout                          # tiny model, 16 prompts x 8 answers, 64 sequences at once
    colocate bench rollout --repeats 8 rollout.partial_tokens=96

Every answer is given a target length drawn from a log-normal distribution (median 40 tokens, sigma 1, at most
480, so a few answers are 10x the median) and the engine really decodes that many tokens (`ignore_eos`): the
lengths of reasoning answers without the cost of a model that reasons. The engine admits `engine.max_num_seqs`
sequences at once, half the answers of a step, as a large engine admits a few hundred of a few thousand.

One runtime, the real job (rollout, score, train, sync, with the full sleep/wake switch), run once per mode with
the same prompt stream and the same lengths:

- none: every answer of the step runs to its end within the step;
- partial: answers get at most `partial_tokens` per pass and go on next step (rollout.partial_tokens);
- over-sampling (carry / drop): 1.5x the groups in flight, the step stops at exactly num_prompts complete
  groups; the rest go on next step or are dropped (rollout.oversample, rollout.leftover).

Per mode: rollout seconds per step, tokens decoded per second, the share of engine steps with fewer than half
the busiest step's sequences (the tail), and the rollout time over a full-batch floor (the same tokens at the
throughput the engine reaches while full, measured in the same pass). Ratios are against `none`, measured in
the same run. The PNG shows sequences decoding over one step's rollout per mode, and each mode's phase times.
Rewards mean nothing here (the lengths are imposed): the benchmark measures time, not learning.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from pathlib import Path

from colocate.bench.common import write_result
from colocate.config import JobConfig
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.rollout.passes import Passes
from colocate.rl.tasks import PromptStream, make_task

ROLLOUT_DEFAULTS = ["model.preset=tiny", "engine.max_model_len=512", "engine.kv_cache_gib=0.125",
                    "engine.max_num_seqs=64", "rollout.num_prompts=16", "rollout.num_samples=8",
                    "rollout.max_tokens=480", "logging.progress=false", "engine.sleep_level=2", "trainer.offload=true"]
MEDIAN_TOKENS, SIGMA = 40, 1.0
MODES = {
    "none": {},
    "partial": {"partial_tokens": 120, "max_lag": 3},
    "oversample_carry": {"oversample": 1.5, "leftover": "carry", "max_lag": 3},
    "oversample_drop": {"oversample": 1.5, "leftover": "drop"},
}


def lognormal_budgets(max_tokens: int, seed: int):
    rng = random.Random(seed)

    def budgets(sample, n: int) -> list[int]:
        return [max(1, min(max_tokens, round(rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA)))) for _ in range(n)]

    return budgets


def run_rollout_bench(cfg: JobConfig, *, num_steps: int, out_dir: str, name: str) -> dict:
    rows, pictures = {}, {}
    with Runtime(cfg) as rt:
        for mode, settings in MODES.items():
            job = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **settings, ignore_eos=True))
            job.check()
            task = make_task(job.rollout.task, length=job.rollout.task_length)
            rollouts = Passes(job, rt.engines, rt.tokenizer, PromptStream(task, seed=job.rollout.seed),
                                budgets=lognormal_budgets(job.rollout.max_tokens, seed=job.rollout.seed))
            controller = Controller(job, rt, rollouts=rollouts)
            records, timelines = [], []
            for step in range(num_steps + 1):  # the first step warms up (and fills the pool of a carrying mode)
                record = controller.step(step)
                if step:
                    records.append(record)
                    timelines.append(rollouts.timelines)
            rows[mode] = _row(records, timelines, settings)
            pictures[mode] = (_running(timelines[-1]), records[-1]["times"])
            print(f"{mode:<17} rollout {rows[mode]['rollout_s']:.2f} s/step, "
                  f"{rows[mode]['tokens_per_s']:.0f} tokens/s, tail {rows[mode]['tail_step_fraction']:.0%}")
        sharing = _prefix_sharing(rt, cfg)
        print(f"prefix sharing: {sharing['prefill_computed_per_group']:.0f} of "
              f"{sharing['prompt_tokens_per_group']} prompt tokens computed per group of {sharing['group_size']}")
    base = rows["none"]
    for row in rows.values():
        row["rollout_s_vs_none"] = row["rollout_s"] / base["rollout_s"]
        row["tokens_per_s_vs_none"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["trained_tokens_per_rollout_s_vs_none"] = (row["trained_tokens_per_rollout_s"]
                                                       / base["trained_tokens_per_rollout_s"])
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "engine_tp": cfg.engine.tp,
                         "max_num_seqs": cfg.engine.max_num_seqs, "num_prompts": cfg.rollout.num_prompts,
                         "num_samples": cfg.rollout.num_samples, "lengths": f"log-normal, median {MEDIAN_TOKENS}, "
                         f"sigma {SIGMA}, at most {cfg.rollout.max_tokens}", "steps_per_mode": num_steps,
                         "enforce_eager": cfg.engine.enforce_eager}, "modes": rows, "prefix_sharing": sharing}
    path = write_result(result, out_dir, name)
    _plot(pictures, Path(out_dir) / f"{name}.png")
    print(f"wrote {path}")
    return result


def _prefix_sharing(rt, cfg: JobConfig, *, num_groups: int = 8, prompt_len: int = 300) -> dict:
    """Prefill the engine computed for groups of `num_samples` answers to one long prompt each, by its own
    count of prompt tokens served from the prefix cache (whole KV blocks only: vLLM's CPU default is 128
    tokens, so a prompt shares its full blocks, not its tail)."""
    import ray

    from colocate.engine.requests import EngineRequest

    g = cfg.rollout.num_samples
    requests = [EngineRequest(f"prefix-{k}-{i}", k, i, [5 + (k * 7 + j) % 30 for j in range(prompt_len)], 1, True,
                              seed=k * g + i) for k in range(num_groups) for i in range(g)]
    out = ray.get(rt.engines[0].run_pass.remote(requests, {"temperature": 1.0, "top_p": 1.0}))
    computed = sum(prompt_len - r.num_cached_tokens for r in out["results"])
    return {"group_size": g, "prompt_tokens_per_group": g * prompt_len,
            "prefill_computed_per_group": computed / num_groups,
            "computed_fraction": computed / (num_groups * g * prompt_len)}


def _row(records: list[dict], timelines: list, settings: dict) -> dict:
    rollout_s = [r["times"]["rollout"] for r in records]
    decoded = sum(r["rollout"]["num_tokens_generated"] for r in records)
    trained_per_step = statistics.fmean(r["num_response_tokens"] for r in records)
    return {
        "settings": settings,
        "rollout_s": statistics.fmean(rollout_s),
        "step_s": statistics.fmean(sum(r["times"].values()) for r in records),
        "tokens_per_s": decoded / sum(rollout_s),
        "trained_tokens_per_step": trained_per_step,
        "trained_tokens_per_rollout_s": trained_per_step / statistics.fmean(rollout_s),
        "groups_per_step": statistics.fmean(r["rollout"]["num_groups"] for r in records),
        "tail_step_fraction": statistics.fmean(r["rollout"]["tail_step_fraction"] for r in records),
        "mean_running": statistics.fmean(r["rollout"]["mean_running"] for r in records),
        "over_full_batch_floor": sum(rollout_s) / _full_batch_floor_s(timelines, decoded),
        "stale_token_fraction": statistics.fmean(r["rollout"]["stale_token_fraction"] for r in records),
        "carried_answers_per_step": statistics.fmean(r["rollout"]["num_answers_carried"] for r in records),
        "dropped_groups": sum(r["rollout"]["num_dropped_groups"] for r in records),
        "lag_restarts": sum(r["rollout"]["num_lag_restarts"] for r in records),
        "engine_steps": sum(len(timeline) for step in timelines for passes in step for timeline in passes),
    }


def _full_batch_floor_s(timelines: list, decoded: int) -> float:
    """Seconds the decoded tokens would take at the engine's full-batch throughput: tokens per second over the
    engine steps that ran at least 90% of the busiest step's sequences."""
    tokens = seconds = 0.0
    for step in timelines:
        for passes in step:
            for timeline in passes:
                peak = max((n for _, n in timeline), default=0)
                previous = 0.0
                for t, n in timeline:
                    if n >= 0.9 * peak:
                        tokens, seconds = tokens + n, seconds + (t - previous)
                    previous = t
    return decoded / (tokens / seconds)


def _running(step_passes: list) -> list[tuple[float, int]]:
    """One step's rollout as (seconds, sequences decoding), its passes one after another (the first engine)."""
    points, offset = [], 0.0
    for passes in step_passes:
        timeline = passes[0]
        points += [(offset + t, n) for t, n in timeline]
        offset += timeline[-1][0] if timeline else 0.0
    return points


def _plot(pictures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 2]})
    for mode, (points, _) in pictures.items():
        top.step([t for t, _ in points], [n for _, n in points], where="post", label=mode, linewidth=1.3)
    top.set_xlabel("seconds into the step's rollout")
    top.set_ylabel("sequences decoding")
    top.set_title("the long tail: sequences decoding during one step's rollout (log-normal answer lengths)")
    top.legend(fontsize=8)
    phases = ["rollout", "score", "switch", "train", "sync"]
    labels = {"switch": "sleep/wake"}
    for y, (mode, (_, times)) in enumerate(pictures.items()):
        left = 0.0
        for i, phase in enumerate(phases):
            width = times.get(phase, 0.0)
            bottom.barh(y, width, left=left, color=f"C{i}", label=labels.get(phase, phase) if y == 0 else None)
            left += width
    bottom.set_yticks(range(len(pictures)), list(pictures))
    bottom.set_xlabel("seconds of one step, by phase")
    bottom.legend(fontsize=8, ncol=len(phases))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
