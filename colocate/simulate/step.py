"""A whole RL step predicted for each way to run the job, side by side, and the best of them.

    predictions = predict_modes(cfg_loader, gpu, gpus=8, lengths=LengthDistribution.parse("lognormal:1500,0.9"))
    best = best_choice(predictions)        # the most trained tokens a second among those that fit in memory

Each candidate is the user's job with a few keys changed (algo.mode, placement.engine_slots,
rollout.partial_tokens, rollout.oversample), checked by the config's own checks and the memory preflight
(job/preflight.py) on the GPU's memory: a candidate that the checks refuse is reported with its one line and never
chosen. The step, by mode:
- sync, co-located: rollout, the switch the preflight plans, train, sync, in turn;
- one_step_off and async, co-located: the same work, time-sliced on the same GPUs (two processes on one GPU ran
  at 0.99x of running them in turn, on an H200), with nothing asleep;
- split (placement.engine_slots = E): the engines generate on their E GPUs while the trainers train on the
  others; a step is the longer of the two sides, the broadcast sync after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from colocate.config import JobConfig
from colocate.errors import ConfigError
from colocate.job.preflight import preflight
from colocate.models.dims import model_dims
from colocate.simulate.hardware import Hardware
from colocate.simulate.lengths import LengthDistribution
from colocate.simulate.phases import EngineModel, Work, overlapped_s, switch_s, sync_s, train_s
from colocate.simulate.rollout import RolloutSim, Speculative

NUM_STEPS = 6
SPLIT_GAIN = 2.0  # two sides on disjoint GPUs share nothing but the broadcast


@dataclass
class Prediction:
    label: str
    keys: dict[str, str]  # what to set, as key=value
    fits: bool = True
    refused: str = ""  # the check's one line, when it does not
    step_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    engine_utilization: float = 0.0  # running answers over the engines' limit, over the rollout's time
    trained_tokens_per_s: float = 0.0
    trained_tokens: float = 0.0
    carried_answers: float = 0.0
    restarts: float = 0.0
    timeline: list[tuple[float, int]] = field(default_factory=list)


def candidates(cfg: JobConfig, gpus: int) -> list[tuple[str, dict[str, str]]]:
    """The job as given, then partial rollout's caps, over-sampling, the overlapped modes and split layouts."""
    tp, max_tokens = cfg.engine.tp, cfg.rollout.max_tokens
    caps = sorted({c for c in (max_tokens // 8, max_tokens // 4, max_tokens // 2) if c >= 16})
    out = [("as configured", {})]
    # each cap with the smallest lag cap that lets the longest answer finish (max_tokens / cap passes)
    out += [(f"sync, partial rollout {c}", {"algo.mode": "sync", **_partial(c, max_tokens)}) for c in caps]
    out += [("sync, over-sampling 1.25", {"algo.mode": "sync", "rollout.oversample": "1.25"})]
    # co-located as labelled, whatever the user's placement.engine_slots (a split, or auto's)
    out += [("one_step_off, co-located", {"algo.mode": "one_step_off", "placement.engine_slots": "0"})]
    cap = caps[-1] if caps else 0
    if cap:
        out += [(f"async, co-located, partial {cap}", {"algo.mode": "async", **_partial(cap, max_tokens),
                                                       "placement.engine_slots": "0"})]
    for engines in sorted({e for e in (gpus // 4, gpus // 2, 3 * gpus // 4) if e >= tp and e % tp == 0}):
        split = {"placement.engine_slots": str(engines)}
        out += [(f"one_step_off, split {engines}+{gpus - engines}", {"algo.mode": "one_step_off", **split})]
        # async with its updates inside the passes, each cap: the update waits about one decode step, which the
        # overlapped step below (the longer side) already assumes; a pass may hold one version more
        out += [(f"async, split {engines}+{gpus - engines}, partial {c}, updates in passes",
                 {"algo.mode": "async", **_partial(c, max_tokens, in_pass=True), **split,
                  "rollout.update_in_pass": "keep"}) for c in caps]
    return out


def _partial(cap: int, max_tokens: int, *, in_pass: bool = False) -> dict[str, str]:
    """Partial rollout's cap with the smallest lag cap that lets the longest answer finish: ceil(max_tokens / cap)
    passes, each a version (and with updates inside them one more: config.schema.a_version_more)."""
    passes = math.ceil(max_tokens / cap)
    return {"rollout.partial_tokens": str(cap), "rollout.max_lag": str(max(1, passes if in_pass else passes - 1))}


def predict_modes(load: Callable[[dict[str, str]], JobConfig], gpu: Hardware, *, gpus: int,
                  lengths: LengthDistribution, prompt_tokens: int,
                  speculative: Speculative | None = None) -> list[Prediction]:
    """`load(keys)`: the user's job with `keys` set, checked (a ConfigError when refused)."""
    base = load({})
    return [predict(load, keys, label, gpu, gpus=gpus, lengths=lengths, prompt_tokens=prompt_tokens,
                    speculative=speculative) for label, keys in candidates(base, gpus)]


def predict(load, keys: dict[str, str], label: str, gpu: Hardware, *, gpus: int, lengths: LengthDistribution,
            prompt_tokens: int, speculative: Speculative | None = None) -> Prediction:
    result = Prediction(label, keys)
    try:
        cfg = load(keys)
        dims = model_dims(cfg)
        plan = preflight(cfg, dims, device="cuda", available_bytes=int(gpu.memory_bytes)).plan
    except ConfigError as e:
        result.fits, result.refused = False, str(e)
        return result
    work = Work.of(cfg, dims, prompt_tokens=prompt_tokens)
    split = cfg.placement.engine_slots > 0
    engine_gpus = cfg.placement.engine_slots if split else gpus
    ranks = gpus - engine_gpus if split else gpus
    engine = EngineModel(work, gpu, tp=cfg.engine.tp, memory_utilization=cfg.engine.gpu_memory_utilization)
    draw = lengths.sampler(seed=cfg.rollout.seed)
    # algo.mode=async's step waits for num_prompts complete groups, over as many passes as that takes; partial
    # rollout's (sync) trains what one pass completed
    whole = cfg.algo.mode == "async"
    rounds = RolloutSim(work, engine, num_engines=engine_gpus // cfg.engine.tp, draw=draw,
                        partial_tokens=cfg.rollout.partial_tokens, oversample=cfg.rollout.oversample,
                        max_lag=cfg.rollout.max_lag, speculative=speculative, take_whole=whole).run(NUM_STEPS)
    tokens, generating = rounds.per_step("trained_tokens"), rounds.per_step("seconds")
    mean_sequence = tokens / max(1.0, rounds.per_step("groups") * work.num_samples)
    micro = cfg.trainer.max_tokens_per_micro_batch or cfg.trainer.micro_batch_size * mean_sequence
    train = train_s(work, gpu, ranks=ranks, tokens=int(tokens), micro_batch_tokens=int(micro),
                    sequence_tokens=mean_sequence, num_updates=cfg.algo.num_updates, num_epochs=cfg.algo.num_epochs,
                    recompute=cfg.algo.recomputes_proximal, critic=cfg.critic.enabled)
    phases = {"rollout": generating, "train": train["seconds"],
              "sync": sync_s(work, gpu, ranks=ranks, engine_tp=cfg.engine.tp, split=split)}
    training = phases["train"] + phases["sync"]
    if split:  # each side on GPUs of its own
        result.step_s = overlapped_s(generating, training, SPLIT_GAIN)
        phases["wait"] = result.step_s - training  # the trainers idle for the engines (or the other way)
    elif cfg.algo.mode == "sync":
        phases["switch"] = switch_s(work, gpu, ranks=ranks, engine_tp=cfg.engine.tp,
                                    sleep_level=plan.engine_sleep_level, offload=plan.trainer_offload)["seconds"]
        result.step_s = sum(phases.values())
    else:  # co-located and overlapped: one GPU's time, sliced between the two processes
        result.step_s = overlapped_s(generating, training, gpu.time_slicing_gain)
    result.phases = phases
    result.trained_tokens = tokens
    result.trained_tokens_per_s = tokens / result.step_s if result.step_s else 0.0
    result.engine_utilization = rounds.mean("utilization") * phases["rollout"] / result.step_s \
        if split else rounds.mean("utilization")
    result.carried_answers = rounds.mean("carried_answers")
    result.restarts = rounds.mean("restarts")
    result.timeline = rounds.timeline
    return result


def best_choice(predictions: list[Prediction]) -> Prediction | None:
    fitting = [p for p in predictions if p.fits and p.step_s > 0 and math.isfinite(p.step_s)]
    return max(fitting, key=lambda p: p.trained_tokens_per_s, default=None)
