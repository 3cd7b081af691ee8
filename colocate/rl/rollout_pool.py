"""The groups in flight between rollout passes: their answers so far, tagged with the policy that sampled each
token, and what each engine request of the next pass must be.

    pool = RolloutPool(cfg.rollout, max_model_len=cfg.engine.max_model_len, seed=cfg.engine.seed)
    pool.top_up(new_groups)                      # new prompts fill the places of the groups trained
    pool.expire(version)                         # the lag cap
    requests = pool.requests(version)            # unfinished answers' next segments (context guard)
    pool.apply(requests, results, version)       # engine results: tokens, logprobs, finish
    groups = pool.take()                         # complete groups, oldest first; the rest carried or dropped

Partial rollout: an answer gets at most `partial_tokens` new tokens per pass (a step makes another pass only
while none of its groups is complete); unfinished, it keeps its tokens and goes on next step under the
newer policy, its next segment seeded from its seed and its length (engine.requests.segment_seed). Each token
keeps the behaviour logprob of the policy that sampled it, so the loss's ratio (and TIS/MIS) corrects the stale
ones; an answer whose oldest token is more than `max_lag` policy versions old, finished or not, is restarted
from its prompt instead (so `max_tokens` must fit in (max_lag + 1) passes, or a long answer could never
finish: RolloutConfig.check refuses it).
Over-sampling: `oversample` x the groups a step trains are in flight; the pass stops once enough are complete.
Context guard: an answer's budget is fixed when it is created, from the model's length, and every segment is
cut to what is left of it: a continued answer never gets a fresh budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from colocate.config import RolloutConfig
from colocate.engine.requests import EngineRequest, RequestResult, segment_seed
from colocate.rl.samples import Answer
from colocate.rl.tasks import Sample


@dataclass
class Group:
    group_id: int
    sample: Sample
    prompt_ids: list[int]
    answers: list[Answer]

    @property
    def complete(self) -> bool:
        return all(a.done for a in self.answers)


@dataclass
class PoolStats:
    """Counters since the last `take`."""
    num_lag_restarts: int = 0
    num_aborted: int = 0
    num_dropped_groups: int = 0
    num_tokens_generated: int = 0

    def reset(self) -> None:
        self.num_lag_restarts = self.num_aborted = self.num_dropped_groups = self.num_tokens_generated = 0


class RolloutPool:
    def __init__(self, rollout: RolloutConfig, *, max_model_len: int, seed: int = 0):
        """`rollout`: the job's section (num_prompts complete groups a step trains, num_samples, oversample,
        partial_tokens, max_lag, leftover); each answer's budget is cut to what `max_model_len` leaves after its
        prompt; `seed`: the answers' seeds derive from it (engine.seed)."""
        self.rollout, self.max_model_len, self.seed = rollout, max_model_len, seed
        self.groups: list[Group] = []
        self.stats = PoolStats()
        self._next_group_id = 0

    @property
    def num_in_flight(self) -> int:
        """Groups kept in flight: `oversample` x the groups a step trains."""
        return math.ceil(self.rollout.num_prompts * self.rollout.oversample)

    # ------------------------------------------------------------------------------------------ filling

    @property
    def num_missing(self) -> int:
        return max(0, self.num_in_flight - len(self.groups))

    def top_up(self, new_groups: list[tuple[Sample, list[int], list[int]]]) -> None:
        """Add groups: (sample, prompt ids, each answer's token budget before the context guard)."""
        for sample, prompt_ids, budgets in new_groups:
            assert len(budgets) == self.rollout.num_samples
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(f"prompt {sample.prompt!r} is {len(prompt_ids)} tokens, leaving no room to answer "
                                 f"within engine.max_model_len={self.max_model_len}")
            gid = self._next_group_id
            self._next_group_id += 1
            seeds = [(self.seed * 1_000_003 + gid * self.rollout.num_samples + i) % 2**31
                     for i in range(len(budgets))]
            self.groups.append(Group(gid, sample, prompt_ids,
                                     [Answer(seed, min(budget, room)) for seed, budget in zip(seeds, budgets)]))

    # ------------------------------------------------------------------------------------------ a pass

    def expire(self, version: int, *, complete_only: bool = False) -> None:
        """At the start of a step under policy `version`: restart every answer whose oldest token is more than
        max_lag versions old, finished ones too (a group waiting on its longest answer, or a complete group
        carried over, must not train stale tokens). `complete_only`: only complete groups' (algo.mode=async
        takes groups while a pass runs, whose unfinished answers must stay as its requests found them)."""
        for group in self.groups:
            if complete_only and not group.complete:
                continue
            for answer in group.answers:
                if answer.versions and version - answer.versions[0] > self.rollout.max_lag:
                    answer.restart()
                    self.stats.num_lag_restarts += 1

    def requests(self, version: int) -> list[EngineRequest]:
        """The next segment of every unfinished answer, under policy `version`."""
        out = []
        for group in self.groups:
            for i, answer in enumerate(group.answers):
                if answer.done:
                    continue
                left = answer.max_tokens - len(answer.token_ids)
                assert left > 0, "an answer with no budget left must have been finished"
                segment = min(left, self.rollout.partial_tokens or left)
                out.append(EngineRequest(
                    request_id=f"g{group.group_id}-a{i}-v{version}-t{len(answer.token_ids)}", group=group.group_id,
                    index=i, prompt_ids=group.prompt_ids + answer.token_ids, max_tokens=segment, final=segment == left,
                    seed=segment_seed(answer.seed, len(answer.token_ids))))
        return out

    def apply(self, requests: list[EngineRequest], results: list[RequestResult], version: int) -> None:
        groups = {g.group_id: g for g in self.groups}
        for request, result in zip(requests, results):
            assert request.request_id == result.request_id
            group = groups[request.group]
            answer = group.answers[request.index]
            answer.token_ids += result.token_ids
            answer.logprobs += result.logprobs
            answer.versions += [version] * len(result.token_ids)
            answer.num_prefill_computed += len(request.prompt_ids) - result.num_cached_tokens
            answer.num_prefill_cached += result.num_cached_tokens
            if result.done(request):
                answer.finish_reason = result.finish_reason
            self.stats.num_aborted += result.finish_reason is None
            self.stats.num_tokens_generated += len(result.token_ids)
            assert len(group.prompt_ids) + len(answer.token_ids) <= self.max_model_len

    def num_complete(self) -> int:
        return sum(g.complete for g in self.groups)

    def quotas(self, num_engines: int, num_groups: int | None = None) -> list[int]:
        """Complete groups each engine must reach in the next pass (groups go to engine group_id % num_engines,
        so a continuation finds its engine's prefix cache): together what the step still lacks of `num_groups`
        (default rollout.num_prompts), none more than an engine has unfinished."""
        wanted = max(0, (self.rollout.num_prompts if num_groups is None else num_groups) - self.num_complete())
        unfinished = [0] * num_engines
        for g in self.groups:
            unfinished[g.group_id % num_engines] += not g.complete
        quotas = [0] * num_engines
        for _ in range(min(wanted, sum(unfinished))):  # round-robin over engines with unfinished groups left
            e = max(range(num_engines), key=lambda i: unfinished[i] - quotas[i])
            quotas[e] += 1
        return quotas

    # ------------------------------------------------------------------------------------------ taking

    def take(self, num_groups: int | None = None) -> list[Group]:
        """Up to `num_groups` (default rollout.num_prompts) complete groups, oldest first. The rest stay for the
        next step (carry) or go."""
        wanted = self.rollout.num_prompts if num_groups is None else num_groups
        complete = [g for g in self.groups if g.complete][:wanted]
        taken = {g.group_id for g in complete}
        self.groups = [g for g in self.groups if g.group_id not in taken]
        if self.rollout.leftover == "drop":
            self.stats.num_dropped_groups += len(self.groups)
            self.groups = []
        return complete

    # ------------------------------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """The groups in flight (unfinished answers with their tokens and versions) as JSON. Each answer's seed
        and length decide its next segment's seed, so a resumed run continues as the saved one would have."""
        return {"next_group_id": self._next_group_id,
                "groups": [{"group_id": g.group_id, "sample": dataclasses.asdict(g.sample), "prompt_ids": g.prompt_ids,
                            "answers": [dataclasses.asdict(a) for a in g.answers]} for g in self.groups]}

    def load_state(self, state: dict) -> None:
        def answer(d: dict) -> Answer:
            d = dict(d)
            # a checkpoint of an earlier release carried the V1 runner's generator state: seeds replace it
            d.pop("random_state", None)
            return Answer(**d)

        self._next_group_id = state["next_group_id"]
        self.groups = [Group(g["group_id"], Sample(**g["sample"]), g["prompt_ids"], [answer(a) for a in g["answers"]])
                       for g in state["groups"]]

    def carried(self) -> dict:
        """What stays in flight: answers and tokens carried to the next step."""
        unfinished = [a for g in self.groups for a in g.answers if not a.done]
        return {"num_groups_carried": len(self.groups), "num_answers_carried": len(unfinished),
                "num_tokens_carried": sum(len(a.token_ids) for a in unfinished)}
