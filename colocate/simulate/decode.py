"""The rollout's decode, step by step: a queue of answers, admitted in order while fewer than a concurrency limit
run, each step adding one token to every running answer, an answer leaving at its length (or at a round's cap,
carried to the next round). The time of one step comes from a roofline the caller gives (simulate/phases.py).

This is the rollout chapter's model, written anew; with the chapter's constants (`chapter_model`) it prints its
numbers, which tests/unit/test_simulate.py pins: median 1,549, longest 16,384, 203 s, 102 s, 54%, 96 s, 145.

    lengths = lognormal_lengths(1024, median=1500, sigma=0.9, low=64, high=16384, seed=0)
    run = decode(lengths, max_running=512, prompt_tokens=512, step_s=chapter_model().step_s)
    run.seconds, run.fraction_under(128), run.num_tokens
    capped = decode(lengths, max_running=512, prompt_tokens=512, step_s=..., cap=4096)   # partial rollout
    capped.num_carried                                                                  # 145

The loop is per step, not per answer (a heap of finish steps; the running count and the context total move by
what enters and leaves), so a 16k-token tail over 1,024 answers runs in a few milliseconds of Python a step-run.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

StepFn = Callable[[int, int], float]  # (running answers, their contexts' total tokens) -> seconds


@dataclass
class DecodeRun:
    seconds: float = 0.0
    num_steps: int = 0
    num_tokens: int = 0
    num_finished: int = 0
    num_carried: int = 0  # answers the cap or the early stop left unfinished: they go on next round
    left: dict[int, int] = field(default_factory=dict)  # answer -> tokens it still needs
    # (seconds at the step's start, running answers): the chapter's picture, one point per change of the count
    timeline: list[tuple[float, int]] = field(default_factory=list)
    seconds_under: dict[int, float] = field(default_factory=dict)  # threshold -> seconds in steps below it
    running_seconds: float = 0.0  # running answers x seconds: over seconds x the limit, the engine's use

    def fraction_under(self, threshold: int) -> float:
        return self.seconds_under[threshold] / self.seconds if self.seconds else 0.0

    @property
    def mean_running(self) -> float:
        return self.num_tokens / self.num_steps if self.num_steps else 0.0


def lognormal_lengths(n: int, *, median: float, sigma: float, low: int, high: int, seed: int = 0) -> list[int]:
    """The chapter's draw: Python's random seeded, int(lognormvariate(ln median, sigma)) clamped to [low, high]."""
    rng = random.Random(seed)
    return [min(high, max(low, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def decode(lengths: list[int], *, max_running: int, prompt_tokens: int, step_s: StepFn, cap: int | None = None,
           groups: list[int] | None = None, stop_after_groups: int | None = None, kv_capacity: int | None = None,
           thresholds: tuple[int, ...] = (128,)) -> DecodeRun:
    """Decode `lengths` (tokens each answer will generate) in queue order. A step's context total counts every
    running answer's prompt and the tokens it holds before the step. `cap`: a round generates at most that many
    tokens of an answer (partial rollout: a longer one is carried). `groups`: each answer's group; with
    `stop_after_groups` the round ends once that many groups have every answer finished (over-sampling's early
    stop: the engine aborts the rest, which are carried). `kv_capacity`: context tokens the KV cache holds; an
    answer is admitted only while its prompt fits beside the running contexts (vLLM's preemption of a running
    answer when the cache fills is not modelled). `run.left[i]`: tokens answer i still needs (carried ones)."""
    run = DecodeRun(seconds_under=dict.fromkeys(thresholds, 0.0))
    left_in_group: dict[int, int] = {}
    for g in groups or []:
        left_in_group[g] = left_in_group.get(g, 0) + 1
    num_complete_groups = 0
    finishing: list[tuple[int, int, int]] = []  # heap of (step it leaves after, answer, tokens this round)
    admitted = [0] * len(lengths)  # the step each answer entered
    nxt = running = context = step = 0
    while nxt < len(lengths) or running:
        while nxt < len(lengths) and running < max_running and \
                (kv_capacity is None or not running or context + prompt_tokens <= kv_capacity):
            target = lengths[nxt] if cap is None else min(lengths[nxt], cap)
            heapq.heappush(finishing, (step + target, nxt, target))
            admitted[nxt] = step
            running += 1
            context += prompt_tokens
            nxt += 1
        if not run.timeline or run.timeline[-1][1] != running:
            run.timeline.append((run.seconds, running))
        dt = step_s(running, context)
        run.seconds += dt
        run.running_seconds += running * dt
        for threshold in thresholds:
            if running < threshold:
                run.seconds_under[threshold] += dt
        run.num_tokens += running
        context += running
        step += 1
        while finishing and finishing[0][0] == step:
            _, i, target = heapq.heappop(finishing)
            running -= 1
            context -= prompt_tokens + target
            if target < lengths[i]:
                run.left[i] = lengths[i] - target
            else:
                run.num_finished += 1
                if groups is not None:
                    left_in_group[groups[i]] -= 1
                    num_complete_groups += left_in_group[groups[i]] == 0
        if stop_after_groups is not None and num_complete_groups >= stop_after_groups:
            for _, i, _ in finishing:  # aborted mid-answer: what it generated is kept
                run.left[i] = lengths[i] - (step - admitted[i])
            run.left.update({i: lengths[i] for i in range(nxt, len(lengths))})
            break
    run.num_carried = len(run.left)
    run.num_steps = step
    run.timeline.append((run.seconds, 0))
    return run


@dataclass(frozen=True)
class Roofline:
    """One decode step: the larger of its compute (2 FLOP per parameter per token at a fraction of peak) and its
    memory traffic (the weights and the KV cache of every context token, once), plus a fixed overhead."""

    params: float
    weight_bytes: float
    kv_bytes_per_token: float
    bandwidth: float  # bytes/s
    peak_flops: float
    compute_efficiency: float = 0.5
    overhead_s: float = 0.4e-3

    def step_s(self, running: int, context: int) -> float:
        compute = 2 * self.params * running / (self.peak_flops * self.compute_efficiency)
        memory = (self.weight_bytes + self.kv_bytes_per_token * context) / self.bandwidth
        return max(compute, memory) + self.overhead_s


def chapter_model() -> Roofline:
    """The chapter's 7B on one H100-class GPU: 7.6e9 parameters, 15.2e9 bytes of bf16 weights, 57,344 bytes of KV
    per context token (28 layers x 4 KV heads x 128 x 2 x 2 bytes), 3.35 TB/s, 989 TFLOP/s."""
    return Roofline(params=7.6e9, weight_bytes=15.2e9, kv_bytes_per_token=57344, bandwidth=3.35e12,
                    peak_flops=989e12)


def chapter_numbers() -> dict:
    """The chapter's printed results, computed: 1,024 answers, 512 at once, prompts of 512 tokens."""
    model = chapter_model()
    lengths = lognormal_lengths(1024, median=1500, sigma=0.9, low=64, high=16384, seed=0)
    full = decode(lengths, max_running=512, prompt_tokens=512, step_s=model.step_s)
    capped = decode(lengths, max_running=512, prompt_tokens=512, step_s=model.step_s, cap=4096)
    full_batch_rate = 512 / model.step_s(512, 512 * (512 + 1500))
    return {"median": sorted(lengths)[len(lengths) // 2], "longest": max(lengths),
            "rollout_s": full.seconds, "full_batch_s": full.num_tokens / full_batch_rate,
            "fraction_under_128": full.fraction_under(128), "capped_s": capped.seconds,
            "carried": capped.num_carried}
