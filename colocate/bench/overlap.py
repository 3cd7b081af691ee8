"""`colocate bench async`: sync against one_step_off and async (algo.mode) on identical work, in one runtime, and
sync and async again on a split placement (half the slots for the engines, the sync broadcast between them), async
with its weight updates between passes and inside them (rollout.update_in_pass=keep).

    colocate bench async                      # tiny model, long-tailed answers, 4 timed steps per variant
    colocate bench async --repeats 8 --variants sync,async_split_in_pass rollout.max_tokens=240

The work is bench rollout's: every answer gets a log-normal target length (median 40 tokens, a few 10x that) and
the engine decodes exactly that many (`ignore_eos`), so rollout is long-tailed: 32 prompts x 8 answers in one
engine batch, rollout about two thirds of a sync step here. The modes run in one runtime with nothing moved (engine
awake, trainer resident: one_step_off's plan), on the same prompt stream and the same lengths, so the only
difference is the schedule. Async runs its passes in segments of a third of rollout.max_tokens
(rollout.partial_tokens), with rollout.max_lag=2 so the longest answer fits in three passes (3 with updates inside
a pass, each of which may add a version). The split variants run in a second runtime on the same slots: the
first half hold the trainer ranks, the rest the engines (TP as large as fits), so each side has its own cores and
the same total; sync_split is the baseline that tells the overlap's share of the split's gain from the layout's.
Per variant: wall seconds per step, trained tokens per second, the seconds each side sits idle per step, the
trainer's wait for the engines before a sync (rollout_wait), and the staleness of the tokens trained.

Next to the measurement, labelled a model: the schedule's own prediction from the sync mode's measured phase
times, one_step_off taking max(rollout, train) + the rest where sync takes rollout + train + the rest. It is the
speed-up where the two sides do not contend (engines and trainers on devices of their own; not two processes
on one GPU, which the GPU time-slices: docs/gpu.md); the measured ratio on this machine's 2 shared cores is the
contended end. The PNG shows engine busy and trainer busy over time for each variant.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from colocate.bench.common import write_result
from colocate.bench.rollout import MEDIAN_TOKENS, ROLLOUT_DEFAULTS, SIGMA, lognormal_budgets
from colocate.config import JobConfig
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.rollout.passes import Passes
from colocate.rl.tasks import PromptStream, make_task

# bench rollout's long tail, with one_step_off's plan for both modes (what moves would differ otherwise)
# 32 prompts x 8 answers, all in one engine batch, at most 160 tokens: rollout is about 64% of a sync step on a
# 2-core CPU (the rollout chapter's long tail: between half and two thirds), so an overlap has training to hide
ASYNC_DEFAULTS = [d for d in ROLLOUT_DEFAULTS if not d.startswith(("engine.sleep_level", "trainer.offload"))] + \
    ["engine.sleep_level=0", "trainer.offload=false", "rollout.max_tokens=160", "rollout.num_prompts=32",
     "engine.max_num_seqs=256"]
MODES = ("sync", "one_step_off", "async")
SYNC_SPLIT = "sync_split"  # sync on a split placement (placement.engine_slots): a runtime of its own
SPLIT = "async_split"  # async on it
SPLIT_IN_PASS = "async_split_in_pass"  # and its weight updates inside the pass in flight (rollout.update_in_pass)
SPLIT_STREAM = "async_split_stream"  # and its rollout streamed: groups taken as they complete (rollout.stream)
SPLIT_VARIANTS = {SYNC_SPLIT: ("sync", "never", False), SPLIT: ("async", "never", False),
                  SPLIT_IN_PASS: ("async", "keep", False), SPLIT_STREAM: ("async", "keep", True)}
VARIANTS = (*MODES, *SPLIT_VARIANTS)
ENGINE_PHASES = ("rollout", "rollout.ahead", "rollout.pass", "eval")  # the spans in which the engines generate
BACKGROUND = ("rollout.ahead", "rollout.pass")  # theirs alone, beside the main thread's steps: labelled with the step
# that collected them, which may have started steps before (a streamed pass runs until its engine runs dry)
TRAINER_PHASES = ("train",)


def run_async_bench(cfg: JobConfig, *, num_steps: int, out_dir: str, name: str,
                    variants: list[str] | None = None) -> dict:
    """Every variant (VARIANTS, or those asked; sync always, every ratio is taken against it) on the same work."""
    asked = ["sync", *[v for v in (variants or VARIANTS) if v != "sync"]]
    rows, timelines = {}, {}
    with Runtime(cfg) as rt:
        for mode in (m for m in MODES if m in asked):
            rows[mode], timelines[mode] = _run_mode(rt, cfg, mode, num_steps)
    # async again with the engines on devices of their own: half the slots, the sync broadcast across
    split = split_config(cfg)
    if set(SPLIT_VARIANTS) & set(asked):
        with Runtime(split) as rt:
            for variant, (mode, in_pass, stream) in SPLIT_VARIANTS.items():
                if variant in asked:
                    rows[variant], timelines[variant] = _run_mode(rt, split, mode, num_steps, in_pass=in_pass,
                                                                  stream=stream, label=variant)
    sync = rows["sync"]
    speedups = {f"{variant}_speedup_measured": sync["step_s"] / row["step_s"]
                for variant, row in rows.items() if variant != "sync"}
    model = _schedule_model(sync)
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "engine_tp": cfg.engine.tp,
                         "num_slots": cfg.placement.num_slots, "num_prompts": cfg.rollout.num_prompts,
                         "num_samples": cfg.rollout.num_samples, "lengths": f"log-normal, median {MEDIAN_TOKENS}, "
                         f"sigma {SIGMA}, at most {cfg.rollout.max_tokens}", "timed_steps_per_mode": num_steps - 1,
                         "rollout_share_of_sync_step": sync["phase_s"].get("rollout", 0.0) / sync["step_s"],
                         SPLIT: {"engine_slots": split.placement.engine_slots, "engine_tp": split.engine.tp,
                                 "num_trainer_ranks": split.placement.num_trainer_ranks}},
              "modes": rows,
              **speedups,
              "schedule_model": model}
    path = write_result(result, out_dir, name)
    _plot(timelines, Path(out_dir) / f"{name}.png")
    print("over sync, measured here: " + ", ".join(f"{k.removesuffix('_speedup_measured')} {v:.2f}x"
                                                   for k, v in speedups.items())
          + f"; one_step_off by the schedule model (no contention between the sides): {model['speedup']:.2f}x")
    print(f"wrote {path}")
    return result


def split_config(cfg: JobConfig) -> JobConfig:
    """The bench's job on a split placement: the last half of its slots for the engines (TP as large as fits)."""
    engine_slots = max(1, cfg.placement.num_slots // 2)
    tp = max(t for t in range(1, min(cfg.engine.tp, engine_slots) + 1) if engine_slots % t == 0)
    split = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, engine_slots=engine_slots),
                                engine=dataclasses.replace(cfg.engine, tp=tp))
    split.check()
    return split


def _run_mode(rt: Runtime, cfg: JobConfig, mode: str, num_steps: int, in_pass: str = "never", stream: bool = False,
              label: str | None = None) -> tuple[dict, list[tuple]]:
    """`num_steps` timed steps of `mode` on the runtime's engines and trainers: the row and the phase spans.
    `in_pass`: async's rollout.update_in_pass; an update inside a pass adds a version to its tokens, so the lag
    cap is one more for the same three segments. `stream`: async's rollout.stream (with in_pass), whole answers:
    a streamed pass feeds new prompts as groups are taken, so it needs no segments to keep its batch full."""
    segments = {"partial_tokens": -(-cfg.rollout.max_tokens // 3),
                "max_lag": 2 if in_pass == "never" else 3, "update_in_pass": in_pass,
                "stream": stream} if mode == "async" else {}
    job = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, mode=mode),
                              rollout=dataclasses.replace(cfg.rollout, ignore_eos=True, **segments))
    job.check()
    task = make_task(job.rollout.task, length=job.rollout.task_length)
    rollouts = Passes(job, rt.engines, rt.tokenizer, PromptStream(task, seed=job.rollout.seed),
                        budgets=lognormal_budgets(job.rollout.max_tokens, seed=job.rollout.seed))
    controller = Controller(job, rt, rollouts=rollouts)
    total = num_steps + 1  # the first step warms up (and, in one_step_off, generates its own answers)
    try:
        records = [controller.step(step, num_steps=total) for step in range(total)][1:-1]
    finally:
        controller.close()
    spans = [s for s in controller.spans if s[1] is not None]
    row = _row(records, spans, steps=range(1, total - 1))
    label = label or mode
    print(f"{label:<19} {row['step_s']:.2f} s/step, {row['trained_tokens_per_s']:.0f} trained tokens/s, idle: "
          f"engine {row['engine_idle_s']:.2f} s, trainer {row['trainer_idle_s']:.2f} s per step, max lag "
          f"{row['max_lag']}, batch {row['mean_running']:.0f}, generated/trained {row['generated_per_trained']:.2f}, "
          f"prefill/group {row['prefill_computed_per_group']:.0f}, sync {row['phase_s'].get('sync', 0.0):.3f} s, "
          f"rollout_wait {row['phase_s'].get('rollout_wait', 0.0):.3f} s")
    return row, spans


def _row(records: list[dict], spans: list[tuple], steps: range) -> dict:
    """Per timed step: the wall time from the first of its main thread's phases to the end of its last, each
    side's busy time within it (the union of its spans, whichever step collected them) and the rest, idle."""
    step_s, engine_busy, trainer_busy = [], [], []
    for step in steps:
        mine = [s for s in spans if s[1] == step and s[0] not in BACKGROUND]
        start, end = min(s[2] for s in mine), max(s[3] for s in mine)
        step_s.append(end - start)
        for busy, names in ((engine_busy, ENGINE_PHASES), (trainer_busy, TRAINER_PHASES)):
            busy.append(_union([(max(s[2], start), min(s[3], end)) for s in spans
                                if s[0] in names and s[2] < end and s[3] > start]))
    wall = statistics.fmean(step_s)
    lags: dict[str, int] = {}
    for r in records:
        for lag, n in r["rollout"]["token_lags"].items():
            lags[lag] = lags.get(lag, 0) + n
    phases = {}
    for r in records:
        for phase, seconds in r["times"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds / len(records)
    return {"step_s": wall, "trained_tokens_per_s": statistics.fmean(r["num_response_tokens"] for r in records) / wall,
            "engine_busy_s": statistics.fmean(engine_busy), "engine_idle_s": wall - statistics.fmean(engine_busy),
            "trainer_busy_s": statistics.fmean(trainer_busy), "trainer_idle_s": wall - statistics.fmean(trainer_busy),
            "rollout_generate_s": statistics.fmean(r["rollout"]["seconds"] for r in records),
            # the engines' batch: sequences decoding per engine step (the long tail lowers it)
            "mean_running": statistics.fmean(r["rollout"]["mean_running"] for r in records),
            # the engines' work per token trained: above 1 where answers restarted by the lag cap were thrown away
            "generated_per_trained": sum(r["rollout"]["num_tokens_generated"] for r in records)
            / max(sum(r["num_response_tokens"] for r in records), 1),
            "num_lag_restarts": sum(r["rollout"]["num_lag_restarts"] for r in records),
            # prompt tokens the engines computed (not served by the prefix cache) per group trained
            "prefill_computed_per_group": statistics.fmean(r["rollout"].get("prefill_computed_per_group", 0.0)
                                                           for r in records),
            "phase_s": phases, "token_lags": lags, "max_lag": max(r["rollout"]["max_lag"] for r in records),
            "stale_token_fraction": statistics.fmean(r["rollout"]["stale_token_fraction"] for r in records)}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _schedule_model(sync: dict) -> dict:
    """A model, not a measurement: sync's measured phases rescheduled, the rollout hidden behind training (or
    training behind the rollout) with no slowdown of either."""
    phases = sync["phase_s"]
    rollout, train = phases.get("rollout", 0.0), phases.get("train", 0.0)
    rest = sum(v for k, v in phases.items() if k not in ("rollout", "train"))
    sync_step, off_step = rollout + train + rest, max(rollout, train) + rest
    return {"what": "sync's measured phase times, rescheduled: one_step_off = max(rollout, train) + rest",
            "rollout_s": rollout, "train_s": train, "rest_s": rest, "sync_step_s": sync_step,
            "one_step_off_step_s": off_step, "speedup": sync_step / off_step}


def _plot(timelines: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 2.2 * len(timelines)), squeeze=False)
    for ax, (mode, spans) in zip(axes[:, 0], timelines.items()):
        origin = min(s[2] for s in spans)
        for row, (side, names, color) in enumerate([("engine", ENGINE_PHASES, "C0"),
                                                     ("trainer", TRAINER_PHASES, "C1")]):
            bars = [(s[2] - origin, s[3] - s[2]) for s in spans if s[0] in names]
            ax.broken_barh(bars, (row - 0.4, 0.8), color=color)
        ax.set_yticks([0, 1], ["engine busy", "trainer busy"])
        ax.set_title({SYNC_SPLIT: "algo.mode=sync, split placement (engines on slots of their own)",
                      SPLIT: "algo.mode=async, split placement",
                      SPLIT_IN_PASS: "algo.mode=async, split placement, weight updates inside the pass",
                      SPLIT_STREAM: "algo.mode=async, split placement, updates inside the pass, rollout streamed"}.get(
                          mode, f"algo.mode={mode}, co-located"), fontsize=9)
        ax.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
