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
Multi-turn (`episodes`, rollout/environments.py): each answer is an episode. A turn ends where the engine stops (EOS);
the environment then steps on the turn's text, and its observation's tokens are appended to the answer (mask 0),
which goes on in the next pass from there. The episode ends when the environment says done, after
rollout.max_turns turns, or when its budget cannot hold the observation and one more token ("length").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass

from colocate.config import RolloutConfig
from colocate.engine.requests import EngineRequest, RequestResult, segment_seed
from colocate.errors import EnvError
from colocate.rollout.environments import Turn
from colocate.rl.routing import decode, encode, extend
from colocate.rl.samples import Answer
from colocate.rl.tasks import Sample


def engine_of(group_id: int, num_engines: int) -> int:
    """The engine that runs every request of a group, in every pass: a continuation finds its engine's prefix
    cache."""
    return group_id % num_engines


@dataclass
class GroupInFlight:
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
    num_env_dropped: int = 0
    """Multi-turn, rollout.env_errors=drop: groups dropped because their environment failed."""
    last_env_error: str = ""

    def reset(self) -> None:
        self.num_lag_restarts = self.num_aborted = self.num_dropped_groups = self.num_tokens_generated = 0
        self.num_env_dropped, self.last_env_error = 0, ""


class RolloutPool:
    def __init__(self, rollout: RolloutConfig, *, max_model_len: int, seed: int = 0, episodes=None,
                 eos_token_id: int | None = None):
        """`rollout`: the job's section (num_prompts complete groups a step trains, num_samples, oversample,
        partial_tokens, max_lag, leftover); each answer's budget is cut to what `max_model_len` leaves after its
        prompt; `seed`: the answers' seeds derive from it (engine.seed). `episodes` (rollout.environments.Episodes):
        multi-turn, with `eos_token_id` ending a turn's text."""
        self.rollout, self.max_model_len, self.seed = rollout, max_model_len, seed
        self.episodes, self.eos_token_id = episodes, eos_token_id
        self.groups: list[GroupInFlight] = []
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
            if self.episodes is not None:
                try:
                    prompt_ids = self._start_episodes(self._next_group_id, sample, len(budgets))
                except EnvError as e:
                    self._env_failed(e)
                    self._next_group_id += 1
                    self.stats.num_env_dropped += 1
                    continue
            room = self.max_model_len - len(prompt_ids)
            if room < 1:
                raise ValueError(f"prompt {sample.prompt!r} is {len(prompt_ids)} tokens, leaving no room to answer "
                                 f"within engine.max_model_len={self.max_model_len}")
            gid = self._next_group_id
            self._next_group_id += 1
            seeds = [(self.seed * 1_000_003 + gid * self.rollout.num_samples + i) % 2**31
                     for i in range(len(budgets))]
            self.groups.append(GroupInFlight(gid, sample, prompt_ids,
                                     [Answer(seed, min(budget, room)) for seed, budget in zip(seeds, budgets)]))

    def _start_episodes(self, group_id: int, sample: Sample, num_answers: int) -> list[int]:
        prompts = self.episodes.start_many([((group_id, i), sample) for i in range(num_answers)])
        error = next((p for p in prompts if isinstance(p, EnvError)), None)
        if error is not None:
            self.episodes.forget((group_id, i) for i in range(num_answers))
            raise error
        if any(p != prompts[0] for p in prompts):
            self.episodes.forget((group_id, i) for i in range(num_answers))
            raise EnvError(f"environment (rollout.env) reset gave the answers of sample {sample.prompt!r} different "
                           "prompts; reset must depend on the sample only (a group's answers share their prompt)")
        return prompts[0]

    # ------------------------------------------------------------------------------------------ a pass

    def expire(self, version: int, *, complete_only: bool = False, skip: Collection[tuple[int, int]] = ()) -> None:
        """At the start of a step under policy `version`: restart every answer whose oldest token is more than
        max_lag versions old, finished ones too (a group waiting on its longest answer, or a complete group
        carried over, must not train stale tokens). `complete_only`: only complete groups' (algo.mode=async
        takes groups while a pass runs, whose unfinished answers must stay as its requests found them). `skip`:
        the (group, answer) of requests in flight (rollout.stream), which must find their answers as they were."""
        failed = set()  # multi-turn, env_errors=drop: groups whose environment failed to start again
        for group in self.groups:
            if complete_only and not group.complete:
                continue
            for i, answer in enumerate(group.answers):
                if (group.group_id, i) in skip:
                    continue
                if answer.versions and version - answer.versions[0] > self.rollout.max_lag:
                    answer.restart()
                    self.stats.num_lag_restarts += 1
                    if self.episodes is not None:  # its episode starts again too (the same prompt)
                        try:
                            self.episodes.start((group.group_id, i), group.sample)
                        except EnvError as e:
                            self._env_failed(e)
                            failed.add(group.group_id)
        self._drop_failed(failed)

    def requests(self, version: int, skip: Collection[tuple[int, int]] = ()) -> list[EngineRequest]:
        """The next segment of every unfinished answer, under policy `version`; `skip`: the (group, answer) of
        requests in flight (rollout.stream)."""
        out = []
        for group, i, answer in self._waiting(skip):
            left = answer.max_tokens - len(answer.token_ids)
            assert left > 0, "an answer with no budget left must have been finished"
            # the turn's end (multi-turn, rollout.max_turn_tokens) ends a request as the budget's end does
            turn_left = min(left, self._turn_tokens_left(answer))
            segment = min(turn_left, self.rollout.partial_tokens or left)
            out.append(EngineRequest(
                request_id=f"g{group.group_id}-a{i}-v{version}-t{len(answer.token_ids)}", group=group.group_id,
                index=i, prompt_ids=group.prompt_ids + answer.token_ids, max_tokens=segment,
                final=segment == turn_left, seed=segment_seed(answer.seed, len(answer.token_ids)),
                num_turn_tokens=answer.num_turn_tokens() if self.episodes is not None else 0))
        return out

    def has_waiting(self, skip: Collection[tuple[int, int]] = ()) -> bool:
        """Whether an unfinished answer has no request in flight (`skip`: the (group, answer) of those that do)."""
        return next(self._waiting(skip), None) is not None

    def _waiting(self, skip: Collection[tuple[int, int]]):
        """(group, answer index, answer) of every unfinished answer not in `skip`, in the pool's order."""
        for group in self.groups:
            for i, answer in enumerate(group.answers):
                if not answer.done and (group.group_id, i) not in skip:
                    yield group, i, answer

    def _turn_tokens_left(self, answer: Answer) -> int:
        limit = self.rollout.max_turn_tokens if self.episodes is not None else 0
        if not limit:
            return answer.max_tokens
        return limit - answer.num_turn_tokens()

    def apply(self, requests: list[EngineRequest], results: list[RequestResult], version: int) -> None:
        groups = {g.group_id: g for g in self.groups}
        turn_ends: list[tuple[GroupInFlight, int]] = []  # multi-turn: the answers whose turn ended, to step at once
        for request, result in zip(requests, results):
            assert request.request_id == result.request_id
            group = groups[request.group]
            answer = group.answers[request.index]
            answer.token_ids += result.token_ids
            answer.logprobs += result.logprobs
            answer.routing = extend(answer.routing, result.routing)  # algo.router_replay (rl/routing.py)
            answer.versions += result.versions or [version] * len(result.token_ids)  # an update in the pass
            answer.num_prefill_computed += len(request.prompt_ids) - result.num_cached_tokens
            answer.num_prefill_cached += result.num_cached_tokens
            if self.episodes is not None:
                answer.turn_starts = answer.turn_starts or [0]  # a new (or restarted) episode's first turn
                answer.mask += [1] * len(result.token_ids)
            if result.done(request):
                if self.episodes is None:
                    answer.finish_reason = result.finish_reason
                else:
                    turn_ends.append((group, request.index))
            self.stats.num_aborted += result.finish_reason is None
            self.stats.num_tokens_generated += len(result.token_ids)
            assert len(group.prompt_ids) + len(answer.token_ids) <= self.max_model_len
        if turn_ends:
            self._end_turns(turn_ends, version)

    def _end_turns(self, ends: list[tuple[GroupInFlight, int]], version: int) -> None:
        """Multi-turn: the engine ended a turn of each of these answers. Step their environments all at once (with
        rollout.env_workers, in parallel across the workers), then, in order, finish each episode or append its
        observation for the next turn. A group whose environment failed is raised (env_errors=fail) or dropped."""
        turns = self.episodes.step_many([
            ((group.group_id, index), group.sample, len(group.answers[index].turn_rewards),
             self._action_text(group.answers[index].actions()[-1])) for group, index in ends])
        failed: set[int] = set()
        for (group, index), turn in zip(ends, turns):
            if group.group_id in failed:
                continue
            if isinstance(turn, EnvError):
                self._env_failed(turn)
                failed.add(group.group_id)
                continue
            self._end_turn(group.answers[index], turn, version)
            assert len(group.prompt_ids) + len(group.answers[index].token_ids) <= self.max_model_len
        self._drop_failed(failed)

    def _env_failed(self, error: EnvError) -> None:
        """An environment failed: raise it (rollout.env_errors=fail), or note it for the caller to drop the group."""
        if self.rollout.env_errors == "fail":
            raise error
        self.stats.last_env_error = str(error)

    def _drop_failed(self, failed: set[int]) -> None:
        if failed:
            self.stats.num_env_dropped += len(failed)
            self.episodes.forget((g, i) for g in failed for i in range(self.rollout.num_samples))
            self.groups = [g for g in self.groups if g.group_id not in failed]

    def _end_turn(self, answer: Answer, turn: Turn, version: int) -> None:
        """The environment answered `answer`'s turn: finish the episode, or append the observation."""
        answer.turn_rewards.append(turn.reward)
        room = answer.max_tokens - len(answer.token_ids)
        # "length" only when the episode's budget ran out (a turn cut at rollout.max_turn_tokens is a turn's end)
        if turn.done or len(answer.turn_rewards) >= self.rollout.max_turns:
            answer.finish_reason = "length" if room == 0 else "stop"
        elif len(turn.observation) >= room:  # no room for the observation and one token of the next turn
            answer.finish_reason = "length"
        else:
            n = len(turn.observation)
            answer.token_ids += turn.observation
            answer.logprobs += [0.0] * n  # not sampled: masked out of the loss, never compared
            answer.versions += [answer.versions[-1] if answer.versions else version] * n  # the turn's last
            answer.mask += [0] * n
            answer.turn_starts.append(len(answer.token_ids))

    @property
    def num_drawn(self) -> int:
        """Groups drawn from the prompt stream so far (their ids are 0 .. num_drawn - 1)."""
        return self._next_group_id

    def num_complete(self) -> int:
        return sum(g.complete for g in self.groups)

    def quotas(self, num_engines: int, num_groups: int | None = None) -> list[int]:
        """Complete groups each engine must reach in the next pass (each group goes to its engine_of): together
        what the step still lacks of `num_groups` (default rollout.num_prompts), none more than an engine has
        unfinished."""
        wanted = max(0, (self.rollout.num_prompts if num_groups is None else num_groups) - self.num_complete())
        unfinished = [0] * num_engines
        for g in self.groups:
            unfinished[engine_of(g.group_id, num_engines)] += not g.complete
        quotas = [0] * num_engines
        for _ in range(min(wanted, sum(unfinished))):  # round-robin over engines with unfinished groups left
            e = max(range(num_engines), key=lambda i: unfinished[i] - quotas[i])
            quotas[e] += 1
        return quotas

    # ------------------------------------------------------------------------------------------ taking

    def take(self, num_groups: int | None = None) -> list[GroupInFlight]:
        """Up to `num_groups` (default rollout.num_prompts) complete groups, oldest first. The rest stay for the
        next step (carry) or go."""
        wanted = self.rollout.num_prompts if num_groups is None else num_groups
        complete = [g for g in self.groups if g.complete][:wanted]
        taken = {g.group_id for g in complete}
        self.groups = [g for g in self.groups if g.group_id not in taken]
        gone = list(complete)
        if self.rollout.leftover == "drop":
            self.stats.num_dropped_groups += len(self.groups)
            gone += self.groups
            self.groups = []
        if self.episodes is not None:
            self.episodes.forget((g.group_id, i) for g in gone for i in range(len(g.answers)))
        return complete

    # ------------------------------------------------------------------------------------------ checkpoints

    def state(self) -> dict:
        """The groups in flight (unfinished answers with their tokens and versions) as JSON. Each answer's seed
        and length decide its next segment's seed, so a resumed run continues as the saved one would have."""
        return {"next_group_id": self._next_group_id,
                "groups": [{"group_id": g.group_id, "sample": dataclasses.asdict(g.sample), "prompt_ids": g.prompt_ids,
                            "answers": [{**dataclasses.asdict(a), "routing": encode(a.routing)} for a in g.answers]}
                           for g in self.groups]}

    def load_state(self, state: dict) -> None:
        def answer(d: dict) -> Answer:
            d = dict(d)
            # a checkpoint of an earlier release carried the V1 runner's generator state: seeds replace it
            d.pop("random_state", None)
            d["routing"] = decode(d.get("routing"))
            return Answer(**d)

        self._next_group_id = state["next_group_id"]
        self.groups = [GroupInFlight(g["group_id"], Sample(**g["sample"]), g["prompt_ids"],
                                     [answer(a) for a in g["answers"]]) for g in state["groups"]]
        if self.episodes is not None:
            self._replay_episodes()

    def _replay_episodes(self) -> None:
        """Multi-turn, after loading a checkpoint: a new environment for every unfinished answer, reset and
        stepped again through the turns it had finished (the environment must be deterministic in its sample
        and actions). A finished answer's environment is not needed again."""
        for group in self.groups:
            for i, answer in enumerate(group.answers):
                if answer.done:
                    continue
                self.episodes.start((group.group_id, i), group.sample)
                for turn, action in enumerate(answer.actions()[:len(answer.turn_rewards)]):
                    self.episodes.step((group.group_id, i), group.sample, turn, self._action_text(action))

    def _action_text(self, action: list[int]) -> str:
        """A turn's text for its environment: the EOS ends the turn in the tokens, not in the text."""
        if self.eos_token_id in action:
            action = action[:action.index(self.eos_token_id)]
        return self.episodes.decode(action)

    def carried(self) -> dict:
        """What stays in flight: answers and tokens carried to the next step."""
        unfinished = [a for g in self.groups for a in g.answers if not a.done]
        return {"num_groups_carried": len(self.groups), "num_answers_carried": len(unfinished),
                "num_tokens_carried": sum(len(a.token_ids) for a in unfinished)}
