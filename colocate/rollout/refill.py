"""DAPO's dynamic sampling: while fewer than rollout.num_prompts of a step's groups have rewards that differ, roll out
and score more. Without algo.dynamic_sampling every group scored trains (`KeepAll`).

    sampling = make_sampling(cfg, rollout, score, trace)   # score: groups -> scored groups (the controller's)
    scored, stats = sampling.refill(step, scored, stats)    # every group sampled; the step's rollout stats

It is handed the mode's rollout driver (rollout/modes.py), the score function and the trace, so its rollouts and
scorings are timed as the step's "rollout" and "score" phases without reaching back into the controller. The
driver says where more groups come from (`take_more`): a collect on the main thread, or with algo.mode=async the
passes already running on the engines, which the refill waits on like a step's take.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from colocate.config import JobConfig
from colocate.rl.samples import Group
from colocate.rl.scoring import ScoredGroup, keep_informative
from colocate.rollout.passes import staleness

ScoreFn = Callable[[list[Group]], list[ScoredGroup]]


class KeepAll:
    """Every group scored trains (algo.dynamic_sampling=false)."""

    def refill(self, step: int, scored: list[ScoredGroup], rollout_stats: dict) -> tuple[list[ScoredGroup], dict]:
        return scored, rollout_stats


class DynamicSampling:
    def __init__(self, cfg: JobConfig, rollout, score: ScoreFn, trace, run_phase=None):
        """`run_phase(name, step, work)`: runs a refill's rollout as the controller runs the step's (under
        fault.engine_restarts, again after a replaced engine); default: once, under the trace's phase."""
        self.wanted, self.max_passes = cfg.rollout.num_prompts, cfg.rollout.max_refill_passes
        self.rollout, self.score, self.trace = rollout, score, trace
        self.run_phase = run_phase or self._phase

    def _phase(self, name: str, step: int, work):
        with self.trace.phase(name, step):
            return work()

    def refill(self, step: int, scored: list[ScoredGroup], rollout_stats: dict) -> tuple[list[ScoredGroup], dict]:
        """Each refill asks the pool for the missing groups over the fraction informative so far (the groups in
        flight decode together, so asking for more costs little time), at most the groups it keeps in flight.
        Returns every group sampled, the first rollout.num_prompts informative ones marked to train
        (rl.scoring.keep_informative; those beyond are surplus, reported and not trained), and the step's rollout
        stats: the refills' passes, seconds and pool counters added, `dynamic_sampling` saying how it went; the
        other figures (prefix sharing, the long tail) stay those of the step's first collect. A step still short
        after its refills trains what it has."""
        stats, pool = dict(rollout_stats), self.rollout.passes.pool
        num_sampled, num_refills = len(scored), 0
        while (num_kept := sum(g.informative for g in scored)) < self.wanted and num_refills < self.max_passes:
            num_refills += 1
            rate = num_kept / num_sampled
            ask = min(pool.num_in_flight, math.ceil((self.wanted - num_kept) / rate) if rate else pool.num_in_flight)
            groups, more = self.run_phase("rollout", step, lambda: self.rollout.take_more(step, ask))
            with self.trace.phase("score", step):
                scored = scored + self.score(groups)
            num_sampled = len(scored)
            stats["group_ids"] = stats["group_ids"] + more["group_ids"]  # every group sampled, kept or not
            stats["num_passes"] += more["num_passes"]
            stats["seconds"] += more["seconds"]
            # the pool's counters run on over a step's collects; what is carried is as the last one left it
            stats.update({k: v for k, v in more.items() if k.startswith("num_") and k not in
                          ("num_groups", "num_passes")})
        num_uniform, num_surplus = keep_informative(scored, self.wanted)
        num_kept = sum(g.trained for g in scored)
        # the staleness of what is trained, the refills' groups in and the filtered ones out
        stats.update(staleness([g.group for g in scored if g.trained], step))
        stats["num_groups"] = num_kept
        stats["dynamic_sampling"] = {
            "num_groups_sampled": num_sampled, "num_groups_kept": num_kept, "num_groups_uniform": num_uniform,
            "filtered_fraction": num_uniform / num_sampled, "num_groups_surplus": num_surplus,
            "num_refills": num_refills, "num_groups_short": self.wanted - num_kept}
        return scored, stats


def make_sampling(cfg: JobConfig, rollout, score: ScoreFn, trace, run_phase=None) -> KeepAll | DynamicSampling:
    """`rollout`: the mode's driver (rollout/modes.py), whose `take_more` gives the refills' groups; `run_phase`:
    DynamicSampling's."""
    return DynamicSampling(cfg, rollout, score, trace, run_phase) if cfg.algo.dynamic_sampling else KeepAll()
