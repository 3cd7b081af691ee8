"""placement.engine_slots=auto: the engine:trainer split a job runs, chosen once in the driver before any actor
starts. job/resolve.py records the choice as a Decision, and `colocate validate` prints it with why.

    slots, why = choose_engine_slots(cfg, device="cpu")                        # no prediction: the most even
    slots, why = choose_engine_slots(cfg, device="cuda", predictor=predictor)  # the simulator's step per split

The values it chooses among are config/schema.py's `split_choices`, each checked as a whole job: with
algo.mode=one_step_off or async, every multiple of engine.tp that leaves the trainers a slot; with algo.mode=sync,
0 alone (its phases run in turn, so a split would only idle each side while the other works).

A `SplitPredictor` scores each: colocate simulate's step on a GPU kind it models (simulate/split.py). job/ cannot
import simulate/, which sits above it (it runs job/'s preflight), so `colocate launch` and `validate` hand it in.
Without one (the CPU, a GPU the simulator does not know, a Ray cluster before it is reached, `run_job` called from
Python) the rule decides: the most even split. A split's step is about its longer side, max(R / E, T / (N - E)),
for rollout work R on E engine slots and training work T on the other N - E (docs/simulate.md); with R and T
unknown, it is at most N / min(E, N - E) times the best split's, whatever R and T are, and the most even split
makes that least (2 where the slots halve into whole engines). A tie goes to the engines: in the long-tailed jobs
a split is for, rollout is the longer phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from colocate.config import JobConfig
from colocate.config.algo import OVERLAPPED_MODES
from colocate.config.schema import split_choices


@dataclass(frozen=True)
class StepPrediction:
    step_s: float
    trained_tokens_per_s: float


@dataclass(frozen=True)
class SplitPredictor:
    """A step predicted for each split the job may take (simulate/split.py builds it)."""
    where: str  # the devices it predicts for, e.g. "8 x H100 SXM 80GB"
    note: str  # what the prediction assumes, said with the choice
    predict: Callable[[JobConfig], StepPrediction | None]  # the job with that split; None: it does not fit


def choose_engine_slots(cfg: JobConfig, *, device: str | None,
                        predictor: SplitPredictor | None = None) -> tuple[int, str]:
    """placement.engine_slots for `cfg` (whose value is auto) and why. `device`: "cpu" or "cuda", None for a Ray
    cluster's (known once connected). ConfigError, one line, when no split fits (config/schema.py split_choices)."""
    choices = split_choices(cfg)
    num_slots, tp = cfg.placement.num_slots, cfg.engine.tp
    if cfg.algo.mode not in OVERLAPPED_MODES:
        return 0, (f"algo.mode={cfg.algo.mode} runs rollout and training in turn: on a split its engines would idle "
                   "while the trainers train and its trainers while the engines generate, so co-located (a split "
                   "pays with algo.mode=one_step_off or async)")
    if len(choices) == 1:
        (slots,) = choices
        return slots, (f"the only split of placement.num_slots={num_slots} into whole engines of engine.tp={tp} "
                       f"that leaves the trainers a slot: {_split_name(slots, num_slots)}")
    if predictor is not None:
        predicted = {slots: predictor.predict(job) for slots, job in choices.items()}
        fitting = {slots: p for slots, p in predicted.items() if p is not None}
        if fitting:
            return _fastest(fitting, predictor, num_slots=num_slots,
                            unfit=[slots for slots, p in predicted.items() if p is None])
        reason = f"no split fits the simulator's memory check on {predictor.where}"
    else:
        reason = {"cpu": "no model ranks splits on the CPU (a calibration measures one layout)",
                  "cuda": "no step prediction for these GPUs"}.get(device, "a Ray cluster's devices are known once "
                                                                          "it is reached")
    slots = max(choices, key=lambda e: (min(e, num_slots - e), e))
    worst = num_slots / min(slots, num_slots - slots)
    return slots, (f"{reason}: the most even split, {_split_name(slots, num_slots)}, whose step is at most "
                   f"{worst:.3g}x the best split's whatever rollout and training take (job/split.py)")


def _fastest(predicted: dict[int, StepPrediction], predictor: SplitPredictor, *, num_slots: int,
             unfit: list[int]) -> tuple[int, str]:
    """The split the predictor gives the most trained tokens a second (colocate simulate's `best`), and the others'
    steps beside it."""
    best = max(predicted, key=lambda e: predicted[e].trained_tokens_per_s)
    others = [f"{e}+{num_slots - e} {predicted[e].step_s:.3g} s" for e in sorted(predicted) if e != best]
    others += [f"{e}+{num_slots - e} does not fit" for e in unfit]
    return best, (f"the split predicted fastest on {predictor.where}: {_split_name(best, num_slots)}, "
                  f"{predicted[best].step_s:.3g} s a step (engine+trainer slots: {', '.join(others)}); "
                  f"{predictor.note}")


def _split_name(engine_slots: int, num_slots: int) -> str:
    def slots(n: int) -> str:
        return f"{n} slot" + ("s" if n > 1 else "")

    return f"engines on {slots(engine_slots)}, trainers on {slots(num_slots - engine_slots)}"
