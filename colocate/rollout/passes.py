"""The rollout phase of a step: passes over the engines until the step has its groups.

    rollouts = Passes(cfg, engines, tokenizer, prompts)
    groups, stats = rollouts.collect(version=step)      # exactly rollout.num_prompts complete groups
    more, stats = rollouts.collect(version=step, num_groups=3, refill=True)   # dynamic sampling's refill

Each pass sends every unfinished answer's next segment to the engine that holds its group (EngineActor.run_pass)
with the number of complete groups that engine must reach; an engine stops there and aborts the rest, which
stay in the pool (rollout.pool) for the next pass or step. Without partial rollout or over-sampling one pass
runs every answer to its end, as `LLM.generate` would. With partial rollout a step trains on the groups
complete after its first pass that completes any (at most num_prompts); over-sampling keeps more groups in
flight and stops at exactly num_prompts.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

import ray

from colocate.config import JobConfig
from colocate.engine.requests import EngineRequest
from colocate.errors import EnvError
from colocate.rollout.pool import GroupInFlight, RolloutPool, engine_of
from colocate.rl.samples import Group
from colocate.rl.tasks import PromptStream, Sample

MAX_ENV_DROPS = 4  # rollout.env_errors=drop: groups dropped per step, as a multiple of those in flight, before failing
BudgetFn = Callable[[Sample, int], list[int]]
"""(sample, number of answers) -> each answer's token budget; the long-tail benchmark draws them."""


@dataclass
class Pass:
    """One pass's requests: each engine's, the complete groups it must reach, the engines with work."""
    version: int
    per_engine: list[list[EngineRequest]]
    quotas: list[int]
    busy: list[int]


class Passes:
    def __init__(self, cfg: JobConfig, engines: list, tokenizer, prompts: PromptStream, *,
                 budgets: BudgetFn | None = None, env_workers: list | None = None):
        """`env_workers`: the runtime's EnvWorker actors (rollout.env_workers), which hold the environments."""
        r = cfg.rollout
        self.engines, self.tokenizer, self.prompts = engines, tokenizer, prompts
        self.pool = RolloutPool(r, max_model_len=cfg.engine.max_model_len, seed=cfg.engine.seed,
                                episodes=_episodes(cfg, tokenizer, env_workers or []),
                                eos_token_id=tokenizer.eos_token_id)
        self.budgets = budgets or (lambda sample, n: [r.max_tokens] * n)
        self.sampling = {"temperature": r.temperature, "top_p": r.top_p, "ignore_eos": r.ignore_eos,
                         # rollout.turn_stop as the tokens the tokenizer gives it: the engine pass ends a turn there
                         "stop_ids": tokenizer(r.turn_stop, add_special_tokens=False).input_ids if r.turn_stop
                         else []}
        self.timelines: list[list[list[tuple[float, int]]]] = []  # last generate: per pass, per engine
        self.decoded = [0, 0]  # since then: the requests' engine steps that produced tokens, and those tokens
        # rollout.stream: the engines' steps in pieces, as looked at, and the streamed passes that ended
        self.stream_steps: list[list[tuple[float, int]]] = []
        self.num_stream_passes = 0
        self.seconds = 0.0  # last generate's wall time
        # a wait on the engines' passes (fault.engine_restarts sets the watchdog's: job/engine_restarts.py)
        self.engine_wait: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._cut_short: tuple[Pass, list] | None = None  # the pass an engine's fault cut short, and its calls

    def collect(self, version: int, *, num_groups: int | None = None,
                refill: bool = False) -> tuple[list[Group], dict]:
        """The step's complete groups (answers sampled by policy `version` or, carried over, older ones): exactly
        `num_groups` (default rollout.num_prompts) without partial rollout. `refill`: a second collect of the same
        step (dynamic sampling), whose pool counters add to the first's."""
        self.generate(version, num_groups=num_groups, refill=refill)
        return self.take(version, num_groups=num_groups)

    def generate(self, version: int, *, trained_version: int | None = None, num_groups: int | None = None,
                 refill: bool = False) -> None:
        """Run passes with the engines' policy `version` until the pool holds the groups a step takes (the first
        half of collect). `trained_version`: the policy the answers will train (algo.mode=one_step_off: the next
        one); the lag cap counts from it. One_step_off calls this in a thread of its own while the trainer works:
        it touches only the pool and the engines, which nothing else uses until `take`."""
        pool = self.pool
        wanted = pool.rollout.num_prompts if num_groups is None else num_groups
        if not refill:
            pool.stats.reset()
        self._fill()
        if not refill:
            pool.expire(version if trained_version is None else trained_version)
        self.timelines, self.decoded = [], [0, 0]
        started = time.perf_counter()
        if self._cut_short is not None:  # this rollout runs again after a replaced engine (fault.engine_restarts)
            self._apply_cut_short()
        while pool.num_complete() < wanted:
            self._fill()  # multi-turn: the places of groups dropped for their environment's failure
            self.timelines.append(self._pass(version, wanted))
            if pool.rollout.partial_tokens and pool.num_complete():
                break  # partial rollout: the step ends with what is complete; the rest goes on next step
        self.seconds = time.perf_counter() - started

    def take(self, trained_version: int, *, num_groups: int | None = None) -> tuple[list[Group], dict]:
        """The complete groups `generate` left in the pool, and the stats of their rollout: staleness counted
        against `trained_version`, the policy they train."""
        groups = self.pool.take(self.pool.rollout.num_prompts if num_groups is None else num_groups)
        rollouts = [_as_rollout(g) for g in groups]
        return rollouts, self._stats(groups, rollouts, trained_version, self.seconds)

    def num_unfinished(self) -> int:
        """Answers in flight that are not finished: what the next pass asks of the engines."""
        return sum(not a.done for g in self.pool.groups for a in g.answers)

    def state(self) -> dict:
        """Where the prompts are and what is in flight, for a checkpoint (JSON)."""
        return {"prompts": self.prompts.state(), "pool": self.pool.state()}

    def load_state(self, state: dict) -> None:
        self.prompts.load_state(state["prompts"])
        self.pool.load_state(state["pool"])

    # ------------------------------------------------------------------ algo.mode=async, one pass at a time
    # rollout/overlap.py's ContinuousRollout calls these from its thread: start_pass and finish_pass under its lock
    # (the main thread takes complete groups meanwhile), run_pass outside it.

    def start_pass(self, version: int) -> Pass | None:
        """Top the pool up with new prompts, restart what the lag cap forbids under policy `version` (a token
        older than it by more than max_lag cannot be trained by it or a later one), and plan a pass that
        advances every unfinished answer by one segment (rollout.partial_tokens); None when every group in
        flight is complete (the pool is full and waits for a step to take some)."""
        pool = self.pool
        self._fill()
        pool.expire(version)
        if pool.num_complete() == len(pool.groups):
            return None
        return self._plan_pass(version, len(pool.groups))

    def _fill(self) -> None:
        """Top up; with an environment that drops groups (rollout.env_errors=drop), again until every place is
        taken: each round draws new prompts, and _top_up ends it once too many were dropped."""
        self._top_up()
        while self.pool.episodes is not None and self.pool.num_missing:
            self._top_up()

    def _top_up(self) -> None:
        """New prompts from the stream into the places of the groups trained or dropped (multi-turn: the pool
        takes each episode's prompt from its environment's reset)."""
        pool = self.pool
        if pool.stats.num_env_dropped > MAX_ENV_DROPS * pool.num_in_flight:
            raise EnvError(f"rollout.env_errors=drop dropped {pool.stats.num_env_dropped} groups since the last step "
                           f"took its own, more than {MAX_ENV_DROPS}x the {pool.num_in_flight} in flight: the "
                           f"environment fails on most samples; the last failure: {pool.stats.last_env_error}")
        samples = self.prompts.next_batch(pool.num_missing)
        prompt_ids = [[] if pool.episodes else self.tokenizer(s.prompt, add_special_tokens=False).input_ids
                      for s in samples]
        pool.top_up([(s, p, self.budgets(s, pool.rollout.num_samples)) for s, p in zip(samples, prompt_ids)])

    def run_pass(self, plan: Pass) -> list[dict]:
        refs = [self.engines[e].run_pass.remote(plan.per_engine[e], self.sampling, plan.quotas[e], plan.version)
                for e in plan.busy]
        try:
            with self.engine_wait():  # fault.engine_restarts: the one place a fault may cut the rollout short
                return ray.get(refs)
        except BaseException:
            self._cut_short = (plan, refs)  # the other engines' passes run on: their answers are kept
            raise

    def regenerated(self, engine: int) -> int:
        """The answers a rollout run again after engine `engine` was replaced generates again: that engine's
        requests of the pass cut short (the others' answers are kept), or every unfinished answer."""
        if self._cut_short is None:
            return self.num_unfinished()
        plan, _ = self._cut_short
        return len(plan.per_engine[engine]) if engine in plan.busy else 0

    def _apply_cut_short(self) -> None:
        """A pass cut short by an engine's fault, when fault.engine_restarts runs the rollout again after replacing
        that engine: the answers of the engines that finished it are applied as a pass's are (the pool has not
        changed since: it was planned from the same state), so only the failed engine's requests are generated
        again. The failed engine's call fails: its actor is gone."""
        plan, refs = self._cut_short
        self._cut_short = None
        with self.engine_wait():
            ray.wait(refs, num_returns=len(refs))
        for e, ref in zip(plan.busy, refs):
            try:
                out = ray.get(ref)
            except Exception:  # the failed engine's (Ray's error for its killed actor)
                continue
            self.pool.apply(plan.per_engine[e], out["results"], plan.version)
            self.timelines.append([out["timeline"]])
            decode = out.get("decode", {})
            self.decoded[0] += decode.get("request_steps", 0)
            self.decoded[1] += decode.get("tokens", 0)

    def finish_pass(self, plan: Pass, outs: list[dict], seconds: float) -> None:
        self._apply(plan, outs)
        self.timelines.append([out["timeline"] for out in outs])
        self.seconds += seconds

    # --------------------------------------------- rollout.stream: requests fed into passes that run on and on
    # rollout/streaming.py's StreamingRollout calls these under its lock, from its thread.

    def stream_requests(self, version: int, in_flight: Collection[tuple[int, int]]) -> list[list[EngineRequest]]:
        """Each engine's new requests under policy `version`: top the pool up (the places of the groups a step
        took), restart what the lag cap forbids among the answers with no request in flight, and the next segment
        (or turn) of every unfinished answer with none; `in_flight`: their (group, answer)."""
        self._fill()
        self.pool.expire(version, skip=in_flight)
        num_engines = len(self.engines)
        per_engine: list[list[EngineRequest]] = [[] for _ in range(num_engines)]
        for r in self.pool.requests(version, skip=in_flight):
            per_engine[engine_of(r.group, num_engines)].append(r)
        return per_engine

    def stream_apply(self, requests: list[EngineRequest], results: list, version: int) -> None:
        """Results as they came back: those of a group no longer in the pool (dropped, for its environment's
        failure, while another of its answers ran) are dropped with it."""
        kept = {g.group_id for g in self.pool.groups}
        pairs = [(q, r) for q, r in zip(requests, results) if q.group in kept]
        if pairs:
            self.pool.apply([q for q, _ in pairs], [r for _, r in pairs], version)

    def stream_progress(self, drained: dict) -> None:
        """An engine's steps since the last look (EngineActor.stream_drain): the step that takes groups next
        counts them, as a pass's are counted by the step that takes its groups."""
        if drained["timeline"]:
            self.stream_steps.append(drained["timeline"])
        self.decoded[0] += drained["decode"]["request_steps"]
        self.decoded[1] += drained["decode"]["tokens"]

    def take_complete(self, trained_version: int, num_groups: int | None = None) -> tuple[list[Group], dict] | None:
        """Async: `num_groups` (default rollout.num_prompts; a dynamic sampling refill's) complete groups whose
        every token policy `trained_version` may train, with the stats of the passes since the last take; None
        while fewer are complete. A complete group with a token too old has those answers restarted (the pass in
        flight holds no request of a complete group)."""
        pool = self.pool
        wanted = pool.rollout.num_prompts if num_groups is None else num_groups
        pool.expire(trained_version, complete_only=True)
        if pool.num_complete() < wanted:
            return None
        taken = self.take(trained_version, num_groups=wanted)
        self.timelines, self.seconds, self.decoded = [], 0.0, [0, 0]
        self.stream_steps, self.num_stream_passes = [], 0
        pool.stats.reset()
        return taken

    def _plan_pass(self, version: int, num_groups: int) -> Pass:
        num_engines = len(self.engines)
        requests = self.pool.requests(version)
        quotas = self.pool.quotas(num_engines, num_groups)
        per_engine = [[r for r in requests if engine_of(r.group, num_engines) == e] for e in range(num_engines)]
        busy = [e for e in range(num_engines) if quotas[e] and per_engine[e]]
        assert busy, "a pass with nothing to do: the pool cannot complete the groups the step lacks"
        return Pass(version, per_engine, quotas, busy)

    def _pass(self, version: int, num_groups: int) -> list[list[tuple[float, int]]]:
        plan = self._plan_pass(version, num_groups)
        outs = self.run_pass(plan)
        self._apply(plan, outs)
        return [out["timeline"] for out in outs]

    def _apply(self, plan: Pass, outs: list[dict]) -> None:
        """Every engine's results at once: a multi-turn pass's turn ends are stepped in one batch (in parallel
        across rollout.env_workers), not one batch per engine."""
        self.pool.apply([r for e in plan.busy for r in plan.per_engine[e]],
                        [result for out in outs for result in out["results"]], plan.version)
        for out in outs:
            decode = out.get("decode", {})
            self.decoded[0] += decode.get("request_steps", 0)
            self.decoded[1] += decode.get("tokens", 0)

    def _stats(self, groups: list[GroupInFlight], rollouts: list[Group], version: int, seconds: float) -> dict:
        answers = [a for g in groups for a in g.answers]
        steps = [n for passes in [*self.timelines, self.stream_steps] for timeline in passes for _, n in timeline]
        peak = max(steps, default=0)
        return {
            "num_groups": len(groups),
            # which groups: with num_groups_drawn, a run's record counts every group drawn (trained once, or still
            # in flight in its last checkpoint's pool), across kills and resumes
            "group_ids": [g.group_id for g in groups],
            "num_groups_drawn": self.pool.num_drawn,
            "num_passes": len(self.timelines) + self.num_stream_passes,
            **self.pool.carried(),
            "num_tokens_generated": self.pool.stats.num_tokens_generated,
            "num_aborted": self.pool.stats.num_aborted,
            "num_lag_restarts": self.pool.stats.num_lag_restarts,
            "num_dropped_groups": self.pool.stats.num_dropped_groups,
            **(turn_stats(answers, self.pool.stats.num_env_dropped) if self.pool.episodes is not None else {}),
            **staleness(rollouts, version),
            # prefix sharing, from the engine's own count of prompt tokens served by its prefix cache
            "prefill_computed_per_group": sum(a.num_prefill_computed for a in answers) / max(len(groups), 1),
            "prefill_cached_per_group": sum(a.num_prefill_cached for a in answers) / max(len(groups), 1),
            # the long tail: engine steps decoding fewer than half the sequences of the busiest step
            "mean_running": statistics.fmean(steps) if steps else 0.0,
            "tail_step_fraction": sum(n < peak / 2 for n in steps) / max(len(steps), 1),
            **_speculation_stats(self.pool.rollout, self.decoded),
            "seconds": seconds,
        }


def _speculation_stats(rollout, decoded: list[int]) -> dict:
    """Tokens an answer gains per engine step (1 without speculative decoding; 1 + the drafts accepted with it),
    and with rollout.speculative the fraction of drafts accepted."""
    per_step = decoded[1] / decoded[0] if decoded[0] else 1.0
    stats = {"tokens_per_request_step": per_step}
    if rollout.speculative:
        stats["speculative_acceptance"] = (per_step - 1) / rollout.speculative_tokens
    return stats


def _episodes(cfg: JobConfig, tokenizer, env_workers: list):
    """rollout.env's episodes (rollout/environments.py; in `env_workers`, Ray actors, when there are any:
    rollout/env_workers.py), or None for single-turn answers."""
    if not cfg.rollout.env:
        return None
    if env_workers:
        from colocate.rollout.env_workers import RemoteEpisodes

        return RemoteEpisodes(env_workers, decode=tokenizer.decode)
    from colocate.rollout.environments import Episodes, make_env_factory

    return Episodes(make_env_factory(cfg.rollout.env, length=cfg.rollout.task_length),
                    tokenize=lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                    decode=tokenizer.decode, timeout_s=cfg.rollout.env_timeout_s)


def turn_stats(answers: list, num_env_dropped: int) -> dict:
    """Multi-turn: turns per episode, and the observation tokens the environments added (not trained)."""
    turns = [len(a.turn_rewards) for a in answers]
    return {"turns_per_episode": statistics.fmean(turns) if turns else 0.0, "most_turns": max(turns, default=0),
            "num_observation_tokens": sum(len(a.mask) - sum(a.mask) for a in answers),
            "num_env_dropped": num_env_dropped}


def staleness(rollouts: list[Group], trained_version: int) -> dict:
    """How old the tokens trained by policy `trained_version` are (partial rollout, over-sampling and
    one_step_off make them older than it). An environment's observation tokens are not trained: not counted."""
    versions = [v for r in rollouts for a in r.completions
                for v, sampled in zip(a.versions, a.mask or [1] * len(a.versions)) if sampled]
    return {"stale_token_fraction": sum(v < trained_version for v in versions) / max(len(versions), 1),
            "max_lag": max((trained_version - v for v in versions), default=0),  # the age of the oldest token
            "token_lags": lag_histogram(versions, trained_version)}


def lag_histogram(versions: list[int], trained_version: int) -> dict[str, int]:
    """Tokens per policy lag (versions behind the policy they train), as {"0": n, "1": m}: JSON keys."""
    counts = Counter(trained_version - v for v in versions)
    return {str(lag): counts[lag] for lag in sorted(counts)}


def _as_rollout(group: GroupInFlight) -> Group:
    return Group(group.sample, group.prompt_ids, list(group.answers))
