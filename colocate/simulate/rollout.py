"""A rollout phase over several steps, as colocate's pool plays it (rollout/pool.py): groups dealt to the engines,
answers decoded (simulate/decode.py), partial rollout's cap a round with the rest carried, over-sampling's early
stop, lag restarts, and prefill with a group's samples sharing their prompt. The steady state is what a long job
sees: the first steps, before carried answers build up, are left out of the means.

    rounds = RolloutSim(work, engine, num_engines=4, draw=lengths.draw, partial_tokens=4096).run(steps=6)
    rounds.mean("seconds"), rounds.mean("trained_tokens"), rounds.timeline   # engine 0's running answers
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from colocate.simulate.decode import decode
from colocate.simulate.phases import EngineModel, Work

WARMUP_STEPS = 2


@dataclass
class Speculative:
    """Speculative decoding in the tail: below `below` running answers, each step proposes `num_draft` tokens
    that are accepted with probability `acceptance` each, at `draft_cost` of a step per drafted token."""

    acceptance: float
    num_draft: int = 4
    draft_cost: float = 0.05
    below: int = 64

    def scale(self, running: int) -> float:
        if running >= self.below:
            return 1.0
        a = self.acceptance
        tokens = (1 - a ** (self.num_draft + 1)) / (1 - a) if a < 1 else self.num_draft + 1
        return (1 + self.num_draft * self.draft_cost) / tokens


@dataclass
class _Group:
    lengths: list[int]
    left: list[int]
    started: int  # the step its oldest token was generated in (a restart starts it again)
    new: bool = True  # its prompt is not yet in the cache


@dataclass
class Rounds:
    steps: list[dict] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # engine 0, last step
    warmup_steps: int = WARMUP_STEPS  # the first steps, left out of the means

    def mean(self, key: str) -> float:
        return statistics.fmean(s[key] for s in self._kept)

    def per_step_of(self, num_groups: int, key: str) -> float:
        """`key` (seconds, trained or decoded tokens) over the passes it takes to complete `num_groups` groups, in
        the steady state: algo.mode=async's step waits for exactly rollout.num_prompts complete groups, however
        many passes of rollout.partial_tokens that takes, where a round (mean) is one pass and trains what it
        completed."""
        completed = sum(s["groups"] for s in self._kept)
        return sum(s[key] for s in self._kept) * num_groups / completed if completed else math.inf

    @property
    def _kept(self) -> list[dict]:
        return self.steps[self.warmup_steps:] if len(self.steps) > self.warmup_steps else self.steps


@dataclass
class RolloutSim:
    work: Work
    engine: EngineModel
    num_engines: int
    draw: Callable[[int], list[int]]  # n -> n answer lengths
    partial_tokens: int = 0
    oversample: float = 1.0
    max_lag: int = 1
    speculative: Speculative | None = None

    def run(self, steps: int = 6) -> Rounds:
        w = self.work
        in_flight = math.ceil(w.num_groups * self.oversample)
        quota = math.ceil(w.num_groups / self.num_engines)
        early_stop = self.oversample > 1 and not self.partial_tokens
        pool: list[_Group] = []
        rounds = Rounds()
        step_fn = self.engine.step_s
        if self.speculative:
            spec = self.speculative
            step_fn = lambda running, context: self.engine.step_s(running, context) * spec.scale(running)  # noqa
        for step in range(steps):
            restarts = self._expire(pool, step) if (self.partial_tokens or self.oversample > 1) else 0
            while len(pool) < in_flight:
                lengths = self.draw(w.num_samples)
                pool.append(_Group(lengths, list(lengths), step))
            seconds, busy, tokens = [], 0.0, 0
            for e in range(self.num_engines):
                mine = [g for i, g in enumerate(pool) if i % self.num_engines == e]
                answers = [(gi, ai) for gi, g in enumerate(mine) for ai, left in enumerate(g.left) if left]
                run = decode([mine[gi].left[ai] for gi, ai in answers], max_running=w.max_num_seqs,
                             prompt_tokens=w.prompt_tokens, step_s=step_fn, cap=self.partial_tokens or None,
                             groups=[gi for gi, _ in answers], kv_capacity=self.engine.kv_capacity_tokens,
                             stop_after_groups=quota if early_stop else None)
                for k, (gi, ai) in enumerate(answers):
                    mine[gi].left[ai] = run.left.get(k, 0)
                prefill = self.engine.prefill_s(w.prompt_tokens * sum(g.new for g in mine))
                for g in mine:
                    g.new = False
                seconds.append(run.seconds + prefill)
                busy += run.running_seconds / max(run.seconds, 1e-12) / w.max_num_seqs
                tokens += run.num_tokens
                if e == 0:
                    rounds.timeline = run.timeline
            complete = [g for g in pool if not any(g.left)][:w.num_groups]
            for g in complete:
                pool.remove(g)
            rounds.steps.append({
                "seconds": max(seconds), "trained_tokens": sum(w.prompt_tokens + n for g in complete
                                                               for n in g.lengths),
                "groups": len(complete), "decoded_tokens": tokens, "restarts": restarts,
                "utilization": busy / self.num_engines, "carried_answers": sum(bool(n) for g in pool for n in g.left)})
        return rounds

    def _expire(self, pool: list[_Group], step: int) -> int:
        """Answers with a token older than max_lag before the policy that would train them start again."""
        restarts = 0
        for g in pool:
            if step - g.started > self.max_lag and any(g.left):
                restarts += sum(n < full for n, full in zip(g.left, g.lengths))  # finished ones too: as old
                g.left, g.started = list(g.lengths), step
        return restarts
