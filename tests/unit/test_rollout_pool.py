"""The rollout pool: over-sampling trains exactly the groups asked for, partial rollout carries answers with
their tokens and version tags, the lag cap restarts stale answers, and no continued answer outgrows the context.

The engine pass is replaced at the actor boundary by `fake_pass`, which follows EngineActor.run_pass's contract
(engine.requests): every running request decodes one token per engine step, stops at EOS (its natural length)
or max_tokens, and the pass aborts what runs once the quota of complete groups is reached. A token depends only
on (the segment's seed, absolute position), as on vLLM's V2 runner; an answer's natural length on the answer
(group, index), so it is the same however the answer is cut into segments. `SEGMENTS` logs what was asked."""

from __future__ import annotations

import json
import random

import pytest

from colocate.config import RolloutConfig
from colocate.engine.requests import EngineRequest, RequestResult, segment_seed
from colocate.rollout.pool import RolloutPool
from colocate.rl.tasks import Sample

EOS = 2
SEGMENTS: dict[tuple[int, int], list[tuple[int, int]]] = {}
"""(group, answer index) -> every segment the fake engine ran for it: (first position, seed)."""


def natural_length(group: int, index: int) -> int:
    """How long this answer wants to be: log-normal-ish, a few very long."""
    return 1 + int(random.Random(group * 1009 + index).lognormvariate(1.5, 0.9))


def token(seed: int, position: int) -> int:
    return 3 + (seed * 7919 + position * 104729) % 40


def fake_pass(requests: list[EngineRequest], num_groups_wanted: int | None, prompt_len: dict) -> list:
    results = {r.request_id: RequestResult(r.request_id, [], [], None, 0) for r in requests}
    running = {r.request_id: r for r in requests}
    left = {}
    for r in requests:
        left.setdefault(r.group, set()).add(r.request_id)
    num_complete = 0
    for r in requests:
        SEGMENTS.setdefault((r.group, r.index), []).append((len(r.prompt_ids) - prompt_len[r.group], r.seed))
    while running and (num_groups_wanted is None or num_complete < num_groups_wanted):
        for rid, r in list(running.items()):
            res = results[rid]
            position = len(r.prompt_ids) - prompt_len[r.group] + len(res.token_ids)
            stop = position + 1 >= natural_length(r.group, r.index)
            res.token_ids.append(EOS if stop else token(r.seed, position))
            res.logprobs.append(-1.0)
            if stop or len(res.token_ids) == r.max_tokens:
                res.finish_reason = "stop" if stop else "length"
                del running[rid]
                if res.done(r):
                    left[r.group].discard(rid)
                    num_complete += not left[r.group]
    return [results[r.request_id] for r in requests]


def run_step(pool: RolloutPool, version: int, rng: random.Random, prompt_len: dict, *, max_tokens: int,
             num_engines: int = 1):
    """What Passes.collect does, with fake engines; every new answer's budget is `max_tokens`."""
    new = []
    for _ in range(pool.num_missing):
        n = rng.randint(3, 6)
        new.append((Sample("p", "a"), list(range(5, 5 + n)), [max_tokens] * pool.rollout.num_samples))
    first_id = pool._next_group_id
    pool.top_up(new)
    for i, (_, prompt, _) in enumerate(new):
        prompt_len[first_id + i] = len(prompt)
    pool.expire(version)
    while pool.num_complete() < pool.rollout.num_prompts:
        requests = pool.requests(version)
        quotas = pool.quotas(num_engines)
        for e in range(num_engines):
            mine = [r for r in requests if r.group % num_engines == e]
            if quotas[e] and mine:
                pool.apply(mine, fake_pass(mine, quotas[e], prompt_len), version)
        if pool.rollout.partial_tokens and pool.num_complete():
            break
    return pool.take()


def answer_of(group: int, index: int, max_tokens: int) -> list[int]:
    """The answer the fake engine's segments make, each token from the seed of the segment it was sampled in."""
    natural = natural_length(group, index)
    starts = dict(SEGMENTS[(group, index)])  # a restarted answer's segments overwrite its earlier ones
    seed = None
    tokens = []
    for p in range(min(natural, max_tokens)):
        seed = starts.get(p, seed)
        tokens.append(EOS if p + 1 >= natural else token(seed, p))
    return tokens


@pytest.mark.parametrize("leftover", ["carry", "drop"])
@pytest.mark.parametrize("num_engines", [1, 2])
def test_over_sampling_trains_exactly_the_groups_asked_for(leftover, num_engines):
    settings = RolloutConfig(num_prompts=4, num_samples=3, oversample=2.0, leftover=leftover)
    pool, rng, prompt_len = RolloutPool(settings, max_model_len=64), random.Random(0), {}
    for version in range(6):
        groups = run_step(pool, version, rng, prompt_len, max_tokens=30, num_engines=num_engines)
        assert len(groups) == 4
        assert all(g.complete for g in groups)
        assert pool.stats.num_aborted > 0 or version > 0  # the pass stopped early at least once
        if leftover == "drop":
            assert pool.groups == []
        else:
            assert len(pool.groups) == 4  # 8 in flight, 4 trained
        pool.stats.reset()


def test_partial_rollout_continues_answers_from_their_segment_seeds_and_tags_versions():
    settings = RolloutConfig(num_prompts=4, num_samples=4, partial_tokens=3, max_lag=100)
    pool, rng, prompt_len = RolloutPool(settings, max_model_len=64), random.Random(1), {}
    carried_any = False
    SEGMENTS.clear()
    for version in range(12):
        for group in run_step(pool, version, rng, prompt_len, max_tokens=40):
            for i, answer in enumerate(group.answers):
                segments = SEGMENTS[(group.group_id, i)]
                # each segment's seed follows from the answer's seed and where the segment starts, nothing else
                assert segments[0] == (0, answer.seed)
                assert all(seed == segment_seed(answer.seed, start) for start, seed in segments)
                assert answer.token_ids == answer_of(group.group_id, i, answer.max_tokens)
                assert len(answer.versions) == len(answer.token_ids)
                assert answer.versions == sorted(answer.versions) and answer.versions[-1] <= version
                carried_any |= answer.versions[0] < version
        # every segment asked of the engine is at most 3 tokens
        assert all(r.max_tokens <= 3 for r in pool.requests(version + 1))
    assert carried_any


@pytest.mark.parametrize("max_lag", [0, 1])
def test_lag_cap_restarts_answers_older_than_k_versions(max_lag):
    # over-sampled and partial: aborted and capped answers wait for later steps, finished ones for their group
    settings = RolloutConfig(num_prompts=2, num_samples=3, oversample=2.0, partial_tokens=10, max_lag=max_lag)
    pool, rng, prompt_len = RolloutPool(settings, max_model_len=64), random.Random(2), {}
    restarts, lags = 0, set()
    for version in range(20):
        for group in run_step(pool, version, rng, prompt_len, max_tokens=10 * (max_lag + 1)):
            for answer in group.answers:
                lags.add(version - answer.versions[0])
        restarts += pool.stats.num_lag_restarts
        pool.stats.reset()
    assert max(lags) == max_lag, "trained tokens are never older than max_lag, and the cap is reached"
    assert restarts > 0


def test_a_continued_answer_never_exceeds_the_context():
    # prompts of 3-6 tokens, max_model_len 12: budgets shrink to what the context leaves, carried or not
    settings = RolloutConfig(num_prompts=3, num_samples=4, partial_tokens=2, max_lag=100)
    pool, rng, prompt_len = RolloutPool(settings, max_model_len=12), random.Random(3), {}
    for version in range(10):
        for group in run_step(pool, version, rng, prompt_len, max_tokens=30):
            for answer in group.answers:
                assert len(group.prompt_ids) + len(answer.token_ids) <= 12
                assert answer.max_tokens == min(30, 12 - len(group.prompt_ids))
        for request in pool.requests(version + 1):
            assert len(request.prompt_ids) + request.max_tokens <= 12


def test_a_prompt_that_fills_the_context_is_refused_with_the_key():
    pool = RolloutPool(RolloutConfig(num_prompts=1, num_samples=1), max_model_len=8)
    with pytest.raises(ValueError, match="engine.max_model_len=8"):
        pool.top_up([(Sample("long", "x"), list(range(8)), [4])])


def test_quotas_split_what_the_step_lacks_over_the_engines_with_work():
    settings = RolloutConfig(num_prompts=5, num_samples=1, oversample=2.0)
    pool = RolloutPool(settings, max_model_len=16)
    pool.top_up([(Sample("p", "a"), [5], [4]) for _ in range(10)])
    assert pool.quotas(2) == [3, 2] or pool.quotas(2) == [2, 3]
    assert sum(pool.quotas(3)) == 5
    pool.groups[0].answers[0].finish_reason = "stop"  # one complete already: the step lacks 4
    assert sum(pool.quotas(2)) == 4


def test_segment_seeds_are_the_answer_seed_first_then_distinct_per_position():
    assert segment_seed(12345, 0) == 12345
    seeds = {segment_seed(s, n) for s in range(50) for n in range(1, 50)}
    assert len(seeds) == 50 * 49  # no two (seed, position) pairs share a stream
    assert all(0 <= s < 2**31 for s in seeds)


def test_a_restored_pool_asks_for_the_same_segments_and_reads_an_older_checkpoint():
    """The checkpoint carries seeds and tokens: a restored pool's next requests are the saved pool's. A state
    written by the release that carried the V1 runner's generator state ('random_state') still loads."""
    settings = RolloutConfig(num_prompts=2, num_samples=2, partial_tokens=3, max_lag=100)
    pool, rng, prompt_len = RolloutPool(settings, max_model_len=64), random.Random(4), {}
    for version in range(3):
        run_step(pool, version, rng, prompt_len, max_tokens=40)
    state = pool.state()
    assert any(a["token_ids"] for g in state["groups"] for a in g["answers"]), "nothing was carried"
    restored = RolloutPool(settings, max_model_len=64)
    restored.load_state(state)
    assert restored.requests(3) == pool.requests(3)
    for g in state["groups"]:
        for a in g["answers"]:
            a["random_state"] = "AAAA"
    older = RolloutPool(settings, max_model_len=64)
    older.load_state(state)
    assert older.requests(3) == pool.requests(3)


def test_an_answers_routing_keeps_each_positions_first_computation_across_segments_and_checkpoints():
    """algo.router_replay: each segment's pass returns rows for every position it ran (its prompt, which holds the
    answer so far, and its new tokens but the last); the answer keeps, for each position, the row of the segment
    that ran it first, and carries it through a checkpoint."""
    import numpy as np

    def routed_pass(requests, num_groups_wanted, lengths):
        results = fake_pass(requests, num_groups_wanted, lengths)
        for r, res in zip(requests, results):  # each row names the segment that computed it: its seed
            res.routing = np.full((len(r.prompt_ids) + len(res.token_ids) - 1, 1, 1), r.seed % 65536, np.uint16)
        return results

    settings = RolloutConfig(num_prompts=2, num_samples=2, partial_tokens=3, max_lag=100)
    pool, rng, prompt_len = RolloutPool(settings, max_model_len=64), random.Random(5), {}
    SEGMENTS.clear()
    checked = 0
    for version in range(8):
        pool.top_up([(Sample("p", "a"), list(range(5, 5 + rng.randint(3, 6))), [30] * 2)
                     for _ in range(pool.num_missing)])
        for g in pool.groups:
            prompt_len.setdefault(g.group_id, len(g.prompt_ids))
        requests = pool.requests(version)
        pool.apply(requests, routed_pass(requests, None, prompt_len), version)
        pool.load_state(json.loads(json.dumps(pool.state())))  # every step through a checkpoint's JSON
        for g in pool.take():
            for i, answer in enumerate(g.answers):
                starts = SEGMENTS[(g.group_id, i)]  # (first answer position, seed) of each segment
                ends = [start for start, _ in starts[1:]] + [len(answer.token_ids)]
                length = len(g.prompt_ids) + len(answer.token_ids) - 1
                # position p: the first segment whose run reached past it
                expected = [next(seed for (_, seed), end in zip(starts, ends) if len(g.prompt_ids) + end - 1 > p)
                            for p in range(length)]
                assert answer.routing[:, 0, 0].tolist() == [seed % 65536 for seed in expected]
                checked += 1
    assert checked
