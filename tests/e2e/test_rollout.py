"""Rollout on the real engine (vLLM CPU, TP=2, fp32): an aborted answer keeps what its seed gave and goes on
from its segment seed, partial rollout and over-sampling inside real steps (train and sync between them) and
reproducible across them, the context guard, and prefix sharing counted by the engine."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from colocate.engine.requests import EngineRequest, segment_seed
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import assert_nothing_left, colocate_processes, shm_segments, small_job

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 48
IGNORE_EOS = {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    before = (colocate_processes(), shm_segments())
    cfg = small_job(tmp_path_factory.mktemp("job"), "engine.dtype=float32", f"engine.max_model_len={MAX_MODEL_LEN}",
                    'engine.extra_args={"block_size": 32}')
    with Runtime(cfg) as rt:
        yield rt
    assert_nothing_left(*before)


def run_pass(rt, requests, sampling=IGNORE_EOS, quota=None):
    return ray.get(rt.engines[0].run_pass.remote(requests, sampling, quota))["results"]


def test_an_aborted_answer_keeps_its_seeds_tokens_and_goes_on_from_its_segment_seed(runtime):
    """Aborted mid-way, an answer holds exactly the first tokens its seed gives uninterrupted; its continuation
    is the plain request of its next segment seed (engine.requests.segment_seed), the same every time it is
    asked, with nothing read from vLLM's model runner."""
    prompt = [5, 6, 7, 16]
    (whole,) = run_pass(runtime, [EngineRequest("whole", 0, 0, prompt, 40, True, seed=99)])
    assert len(whole.token_ids) == 40

    def head_then_tail(tag: str):
        # a one-token group completes first; with a quota of one group the long answer is aborted mid-way
        head, _ = run_pass(runtime, [EngineRequest(f"head-{tag}", 0, 0, prompt, 40, True, seed=99),
                                     EngineRequest(f"short-{tag}", 1, 0, prompt, 1, True, seed=5)], quota=1)
        assert head.finish_reason is None and 0 < len(head.token_ids) < 40
        (tail,) = run_pass(runtime, [EngineRequest(f"tail-{tag}", 0, 0, prompt + head.token_ids,
                                                   40 - len(head.token_ids), True,
                                                   seed=segment_seed(99, len(head.token_ids)))])
        return head, tail

    head, tail = head_then_tail("a")
    assert head.token_ids == whole.token_ids[:len(head.token_ids)]
    np.testing.assert_allclose(head.logprobs, whole.logprobs[:len(head.logprobs)], atol=1e-4)
    assert len(head.token_ids + tail.token_ids) == 40
    again_head, again_tail = head_then_tail("b")
    assert (again_head.token_ids, again_tail.token_ids) == (head.token_ids, tail.token_ids)


def test_samples_of_a_prompt_share_its_prefill(runtime):
    """G samples of a 70-token prompt (block size 32): the engine serves the first two blocks of all but the
    first sample from its prefix cache."""
    prompt = [5 + i % 10 for i in range(40)]
    results = run_pass(runtime, [EngineRequest(f"s{i}", 0, i, prompt, 2, True, seed=i) for i in range(4)])
    cached = sorted(r.num_cached_tokens for r in results)
    assert cached[-1] == 32 and sum(cached) >= 3 * 32 - 32, cached  # at most the first computes the block


def steps(controller: Controller, num_steps: int):
    """Controller.step's phases, keeping each step's groups."""
    for step in range(num_steps):
        groups, stats = controller.rollout.take(step)
        scored = controller.advantages(controller.score(groups))
        controller.switch_to_train()
        controller.train(scored, step)
        controller.switch_to_sync()
        controller.sync()
        controller.switch_to_rollout()
        yield step, groups, stats


def job(runtime, algo: dict | None = None, **rollout) -> Controller:
    cfg = runtime.cfg
    # one-answer groups have no group baseline: REINFORCE++'s batch baseline trains them
    algo = {"advantage": "reinforce_pp", **(algo or {})} if rollout.get("num_samples") == 1 else (algo or {})
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout),
                              algo=dataclasses.replace(cfg.algo, **algo))
    cfg.check()
    return Controller(cfg, runtime)


def test_over_sampling_trains_exactly_the_groups_asked_for(runtime):
    # 12 one-answer groups in flight, stopping at EOS (an untrained model samples it now and then) or at 40:
    # the third to stop ends the pass
    controller = job(runtime, num_prompts=3, num_samples=1, max_tokens=40, oversample=4.0, leftover="carry")
    aborted = 0
    for step, groups, stats in steps(controller, 3):
        assert len(groups) == 3 == stats["num_groups"]
        assert all(c.finish_reason in ("stop", "length") for g in groups for c in g.completions)
        aborted += stats["num_aborted"]
    assert aborted > 0  # the passes stopped before every group in flight was complete


def test_partial_rollout_carries_answers_over_steps_within_the_context(runtime):
    """Budgets: max_tokens=45 but a 4-token prompt leaves 44 in a 48-token context; answers get 12 tokens per
    pass and finish over several steps, sampled by several policy versions, never past the context. One-answer
    groups, so groups complete at different passes (a step ends at the first pass that completes one)."""
    controller = job(runtime, num_prompts=6, num_samples=1, max_tokens=45, partial_tokens=12, max_lag=3)
    mixed_versions = longest = 0
    for step, groups, stats in steps(controller, 5):
        assert 1 <= len(groups) <= 6
        for group in groups:
            for completion in group.completions:
                total = len(group.prompt_ids) + len(completion.token_ids)
                assert total <= MAX_MODEL_LEN
                longest = max(longest, total)
                versions = completion.versions
                assert step - versions[0] <= 3
                mixed_versions += versions[0] != versions[-1]
    assert mixed_versions > 0, "no trained answer was continued across a weight sync"
    assert longest == MAX_MODEL_LEN, "no answer reached the context limit: the guard was not exercised"


def test_answers_continued_across_steps_are_reproducible_when_weights_do_not_change(runtime):
    """Partial rollout over real steps with every switch and sync between them but no training (the weights
    stay the same, though level-2 sleep discards them and the sync writes them back): a second run of the same
    job trains exactly the same answers, continued ones included. Their seeds follow from the answers alone."""
    def answers_of_a_run():
        controller = job(runtime, num_prompts=4, num_samples=2, max_tokens=40, partial_tokens=8, max_lag=4)
        answers, continued = [], 0
        for step in range(4):
            groups, _ = controller.rollout.take(step)
            controller.switch_to_train()
            controller.switch_to_sync()
            controller.sync()
            controller.switch_to_rollout()
            for group in groups:
                for c in group.completions:
                    answers.append((step, group.prompt_ids, c.seed, c.token_ids, c.versions))
                    continued += len(set(c.versions)) > 1
        return answers, continued

    first, continued = answers_of_a_run()
    assert continued > 0, "no answer was continued across a step"
    second, _ = answers_of_a_run()
    assert [a[:4] for a in second] == [a[:4] for a in first]


def test_dynamic_sampling_trains_exactly_the_informative_groups_asked_for(runtime):
    """DAPO's dynamic sampling in real steps: the groups trained are exactly rollout.num_prompts, each with
    rewards that differ, their answers and nothing else in the batch; uniform groups are refilled through the
    pool and counted."""
    controller = job(runtime, algo={"dynamic_sampling": True}, num_prompts=4, num_samples=4, max_tokens=4,
                     max_refill_passes=6)
    for step in range(3):
        groups, stats = controller.rollout.take(step)
        scored, stats = controller.sampling.refill(step, controller.score(groups), stats)
        batch = controller.advantages(scored)
        trained = [g for g in scored if g.trained]
        assert len(trained) == 4 == stats["num_groups"] and all(max(g.rewards) > min(g.rewards) for g in trained)
        assert [s.response_ids for s in batch.sequences] == \
            [a.token_ids for g in trained for a in g.group.completions]
        sampling = stats["dynamic_sampling"]
        assert sampling["num_groups_sampled"] == len(scored) == 4 + sampling["num_groups_uniform"] + \
            sampling["num_groups_surplus"]
        assert sampling["num_refills"] == stats["num_passes"] - 1  # one pass per collect, no partial rollout
        controller.switch_to_train()
        controller.train(batch, step)
        controller.switch_to_sync()
        controller.sync()
        controller.switch_to_rollout()


# ----------------------------------------------------------------- a weight update inside a pass (update_in_pass)

GREEDY = {"temperature": 0.0, "top_p": 1.0, "ignore_eos": True}


def disk_and_perturbed_weights(runtime) -> tuple[dict, dict]:
    """The model's weights as its files hold them, and a copy moved far from them (each tensor plus half its own
    spread in seeded noise): two policies whose greedy answers and log-probs differ."""
    import torch
    from safetensors.torch import load_file

    old = {}
    for path in sorted(Path(runtime.model_path).glob("*.safetensors")):
        old.update(load_file(path))
    generator = torch.Generator().manual_seed(0)
    new = {name: t + 0.5 * t.float().std().nan_to_num() * torch.randn(t.shape, generator=generator).to(t.dtype)
           for name, t in old.items()}
    return old, new


def update_inside_a_pass(runtime, kv: str, old: dict, new: dict, *, max_tokens: int = 40):
    """Two greedy answers under `old`, as policy version v (above any the engine held: versions only grow); once
    their pass has run 6 engine steps it is parked, `new` is loaded (the naive sync, through the same control calls
    as every sync), and the pass goes on under version v + 1."""
    engine, prompt = runtime.engines[0], [5, 6, 7, 16]
    v = (ray.get(engine.pass_progress.remote())["version"] or 0) + 1
    ray.get(engine.load_state.remote(old))
    requests = [EngineRequest(f"inpass-{kv}-{i}", i, 0, prompt, max_tokens, True, seed=i) for i in range(2)]
    running = engine.run_pass.remote(requests, GREEDY, None, v)
    deadline = time.monotonic() + 120
    while not ((progress := ray.get(engine.pass_progress.remote()))["in_pass"] and progress["steps"] >= 6):
        assert time.monotonic() < deadline, progress
        time.sleep(0.002)
    assert ray.get(engine.pause_pass.remote()), "the pass ended before the update could enter it"
    ray.get(engine.load_state.remote(new))
    ray.get(engine.resume_pass.remote(v + 1, kv))
    out = ray.get(running)
    results = out["results"]
    k = results[0].versions.count(v)
    for r in results:
        assert len(r.token_ids) == max_tokens
        assert r.versions == [v] * k + [v + 1] * (max_tokens - k), r.versions  # [k, ..., k, k + 1, ...]
    assert 6 <= k < max_tokens and out["parked_s"] > 0
    return prompt, results, k


def continuation(runtime, prompt: list[int], head: list[int], num_tokens: int, tag: str):
    """A fresh request over prompt + head under the engine's weights now: every KV computed by them."""
    (result,) = run_pass(runtime, [EngineRequest(tag, 0, 0, prompt + head, num_tokens, True, seed=0)], GREEDY)
    return result


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_tokens_after_an_update_inside_a_pass_are_the_new_weights(runtime, kv):
    """rollout.update_in_pass on the real engine (TP=2, fp32, greedy): the tokens before the update are the old
    weights' and are tagged with the pass's version, those after with the next, and are not the old weights' (the
    update is not a silent no-op). recompute: the answers' KV is computed again, so their tokens after the update
    are exactly what a fresh request over the same prefix gives under the new weights. keep: the first token after
    the update is computed by the new weights over the old weights' KV, so its log-prob is neither policy's alone."""
    old, new = disk_and_perturbed_weights(runtime)
    try:
        prompt, results, k = update_inside_a_pass(runtime, kv, old, new)
        n = len(results[0].token_ids)
        for i, r in enumerate(results):
            under_new = continuation(runtime, prompt, r.token_ids[:k], n - k, f"new-{kv}-{i}")
            if kv == "recompute":
                assert under_new.token_ids == r.token_ids[k:]
                np.testing.assert_allclose(r.logprobs[k:], under_new.logprobs, atol=1e-3)
            else:
                assert abs(r.logprobs[k] - under_new.logprobs[0]) > 1e-4  # the old KV is still read
        ray.get(runtime.engines[0].load_state.remote(old))
        for i, r in enumerate(results):
            (whole_old,) = run_pass(runtime, [EngineRequest(f"old-{kv}-{i}", 0, 0, prompt, k, True, seed=i)], GREEDY)
            assert whole_old.token_ids == r.token_ids[:k]  # before the update: the old weights' tokens
            np.testing.assert_allclose(r.logprobs[:k], whole_old.logprobs, atol=1e-3)
            under_old = continuation(runtime, prompt, r.token_ids[:k], n - k, f"old-cont-{kv}-{i}")
            assert abs(r.logprobs[k] - under_old.logprobs[0]) > 1e-2, "the update inside the pass was a no-op"
    finally:
        ray.get(runtime.engines[0].load_state.remote(old))


def test_a_pass_whose_prefills_outgrow_one_engine_step_runs_them_whole(runtime):
    """240 seeded requests of 40 distinct prompt tokens each (9,600 tokens, beyond a step's 8,192 at TP=2): a
    prefill split over two steps would make vLLM rewind a seeded CPU generator, which it cannot (the engine runs
    whole prefills on the CPU: EngineActor._llm_kwargs). A recompute after an update inside a pass, or a partial
    rollout's next segments, is such a pass."""
    prompts = np.random.default_rng(0).integers(5, 45, size=(240, 40)).tolist()  # no prefix in common
    requests = [EngineRequest(f"wide-{i}", i, 0, prompt, 2, True, seed=i) for i, prompt in enumerate(prompts)]
    results = run_pass(runtime, requests, {"temperature": 1.0, "top_p": 1.0, "ignore_eos": True})
    assert all(len(r.token_ids) == 2 and r.finish_reason == "length" for r in results)


# ------------------------------------------------------------------------------- a streamed pass (rollout.stream)

def test_a_streamed_pass_hands_back_each_answer_as_it_ends_and_takes_requests_while_it_runs(runtime):
    """rollout.stream on the real engine: a one-token answer leaves through the stream while the 40-token one of the
    same pass still runs; a request fed into the running pass runs in it, as it would alone; every result leaves
    once (drained, or in the pass's return); and a pass that has ended refuses what is fed to it."""
    engine, prompt = runtime.engines[0], [5, 6, 7, 16]
    v = ray.get(engine.pass_progress.remote())["version"] or 0
    ray.get(engine.stream_drain.remote(0.0))  # nothing left from an earlier streamed pass
    running = engine.run_pass.remote([EngineRequest("st-long", 0, 0, prompt, 40, True, seed=1),
                                      EngineRequest("st-short", 1, 0, prompt, 1, True, seed=2)], IGNORE_EOS, None, v,
                                     True)
    deadline = time.monotonic() + 120
    while not ((progress := ray.get(engine.pass_progress.remote()))["in_pass"] and progress["steps"] >= 3):
        assert time.monotonic() < deadline, progress
        time.sleep(0.002)
    assert ray.get(engine.pause_pass.remote()), "the pass ended before it could be held"  # now it cannot end
    looks = [ray.get(engine.stream_drain.remote(0.0))]
    drained = looks[0]["results"]
    assert [r.request_id for r in drained] == ["st-short"] and len(drained[0].token_ids) == 1
    fed = EngineRequest("st-fed", 2, 0, [9, 8, 7], 3, True, seed=3)
    assert ray.get(engine.stream_feed.remote([fed]))
    ray.get(engine.resume_pass.remote(v, "keep"))
    out = ray.get(running)
    looks.append(ray.get(engine.stream_drain.remote(0.0)))
    drained += looks[-1]["results"]
    assert out["results"] == [] and out["timeline"] == []  # all left through the stream, the steps too
    # every engine step reported once, in the looks: 44 tokens, one a request and step (no speculation)
    assert sum(len(look["timeline"]) for look in looks) == ray.get(engine.pass_progress.remote())["steps"]
    assert [sum(look["decode"][k] for look in looks) for k in ("request_steps", "tokens")] == [44, 44]
    by_id = {r.request_id: r for r in drained}
    assert sorted(by_id) == ["st-fed", "st-long", "st-short"] and len(drained) == 3
    assert [len(by_id[i].token_ids) for i in ("st-long", "st-fed")] == [40, 3]
    (alone,) = run_pass(runtime, [dataclasses.replace(fed, request_id="st-fed-alone")])
    assert alone.token_ids == by_id["st-fed"].token_ids
    np.testing.assert_allclose(alone.logprobs, by_id["st-fed"].logprobs, atol=1e-4)
    assert not ray.get(engine.stream_feed.remote([dataclasses.replace(fed, request_id="st-late")]))


def test_a_streamed_pass_reads_no_prefix_cached_under_other_weights(runtime):
    """A streamed pass salts each request's prefix-cache hashes with the weights' version: a 40-token prompt (one
    full 32-token block) is served from the cache to a later pass of the same version, never to one of the next
    (whose pass may have been fed after an update inside it, the prefix computed by the old weights)."""
    engine, prompt = runtime.engines[0], [5 + i % 11 for i in range(40)]
    v = ray.get(engine.pass_progress.remote())["version"] or 0

    def streamed(tag: str, version: int):
        out = ray.get(engine.run_pass.remote([EngineRequest(tag, 0, 0, prompt, 1, True, seed=0)], IGNORE_EOS,
                                             None, version, True))
        (result,) = ray.get(engine.stream_drain.remote(0.0))["results"] + out["results"]
        return result

    streamed("salt-a", v)
    assert streamed("salt-b", v).num_cached_tokens == 32
    assert streamed("salt-c", v + 1).num_cached_tokens == 0
