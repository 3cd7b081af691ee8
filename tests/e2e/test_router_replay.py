"""Router replay (algo.router_replay, R3) on the real stack: vLLM's CPU build captures each token's experts
(engine/routing.py), the trainer replays them (trainer/router_replay.py).

In fp32 at TP=1 the two sides' routers see nearly the same hidden states, so the trainer's own choice is the
engine's for nearly every token and layer: a capture misaligned by one position, one layer or one request would
agree about as often as two random top-2 choices of 8 experts (about 1 in 28). With replay on, the experts the
trainer used are the engine's, every one."""

from __future__ import annotations

import numpy as np
import pytest

from colocate.bench.mismatch import sample, score
from colocate.bench.routing import measure
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import small_job

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 6, 7, 8] * 5 + [16], [9, 8, 16], [7, 7, 5, 6, 16], [6, 5, 16]]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "routing": True}  # each sample with its routing


def test_the_engine_captures_every_tokens_experts_and_the_trainer_replays_them(tmp_path):
    cfg = small_job(tmp_path, "model.preset=tiny-moe", "engine.dtype=float32", "engine.tp=1",
                    "placement.num_slots=1", "algo.router_replay=true")
    with Runtime(cfg) as rt:
        seqs = sample(rt, PROMPTS, {**SAMPLING, "n": 3, "max_tokens": 24, "seed": 3})
        assert len(seqs) == 12
        for s in seqs:  # every position the engine ran: the prompt and the answer but its last token
            assert s.routing.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2), s.routing.shape
            assert s.routing.max() < 8
        free = [s.__class__(s.prompt_ids, s.response_ids, s.logprobs, 0.0) for s in seqs]
        own = score(rt, free, method="score_routing")
        rows = np.concatenate([s.routing for s in seqs])
        mine = np.concatenate([o[1][:len(s.routing)] for s, o in zip(seqs, own)])
        # the same experts as a set (vLLM's CPU top-k and torch's may order two close scores apart)
        agree = (np.sort(rows, axis=-1) == np.sort(mine, axis=-1)).all(axis=-1).mean()
        assert agree >= 0.99, agree  # measured 1.0
        replayed = score(rt, seqs, method="score_routing")
        for s, (_, own_choice, used) in zip(seqs, replayed):
            # every position the engine ran is routed as the engine routed it; the last one as the trainer chooses
            assert np.array_equal(used[:-1], s.routing) and np.array_equal(used[-1], own_choice[-1])
        assert [r[0] for r in replayed] == score(rt, seqs)  # score_routing's forward is the loss's
        # the first prompt again: its first block (16 tokens) is a prefix-cache hit, not computed by this request;
        # its rows are read from the cached slots, those of the forward that computed the keys and values
        again = sample(rt, PROMPTS[:1], {**SAMPLING, "n": 1, "max_tokens": 4, "seed": 9})
        assert np.array_equal(again[0].routing[:21], seqs[0].routing[:21])


def test_a_job_with_router_replay_trains_each_answer_under_the_engines_routing(tmp_path):
    """The default task on tiny-moe, bf16 engine at TP=2, partial rollout: answers continue over passes and
    steps, each keeps a row for every position the engine ran, and each step's record says how many trained
    tokens the replay routed against the trainer's own choice."""
    cfg = small_job(tmp_path, "model.preset=tiny-moe", "algo.router_replay=true", "rollout.max_tokens=12",
                    "rollout.partial_tokens=4", "rollout.max_lag=4", "algo.num_steps=3")
    with Runtime(cfg) as rt:
        # bench routing's measurement on this runtime, before the job (bf16 engine, fp32 trainer): every answer
        # token classed once, and the replay brings the flipped tokens' mismatch down
        row = measure(rt, PROMPTS, {**SAMPLING, "n": 4, "max_tokens": 24, "seed": 1})
        classes = row["classes"]
        assert classes["all"]["tokens"] == row["answer_tokens"] == classes["flipped_before"]["tokens"] \
            + classes["clean"]["tokens"] > 100
        if classes["flipped_here"]["tokens"]:
            assert classes["flipped_here"]["replayed"]["mean_abs"] < classes["flipped_here"]["free"]["mean_abs"]
        controller = Controller(cfg, rt)
        continued = 0
        for step in range(3):
            groups, _ = controller.rollout.take(step)
            for g in groups:
                for a in g.completions:
                    assert a.routing.shape == (len(g.prompt_ids) + len(a.token_ids) - 1, 2, 2)
                    continued += len(a.token_ids) > 4  # run in more than one segment
            scored = controller.advantages(controller.score(groups))
            assert all(s.routing is not None for s in scored.sequences)
            controller.switch_to_train()
            record = controller.train(scored, step)
            assert 0 <= record["routing_flipped"] < 0.5, record["routing_flipped"]  # bf16 engine, fp32 trainer
            controller.switch_to_sync()
            controller.sync()
            controller.switch_to_rollout()
        assert continued, "no trained answer was continued from an earlier segment"
