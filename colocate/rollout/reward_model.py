"""Rewards from a model: a sequence classifier's score or a generative judge's parsed verdict, served by a vLLM
engine of the job's own (engine/reward_engine.py) and used as one component of rollout.rewards.

    rollout.rewards=model:tiny-rm          # or math:1,model:/models/my-rm:0.5, or judge:/models/my-judge
    reward = RewardModel(actor, kind="model")  # the runtime starts the actor; make_reward binds it
    reward(prompts, responses, answers)    # batched: one call to the engine per step, every sample at once
    reward.take_stats()                    # {"kind", "num_scored", "num_truncated", "num_unparsed", "seconds",
                                           #  "sleep_freed_bytes" once it slept}

What the model reads is built in its engine (engine/reward_engine.py), from text, with the reward model's own
tokenizer (it need not be the policy's):
- a classifier reads the prompt and the answer as a user turn and an assistant turn of its chat template when
  its tokenizer has one (reward models are trained on chats), else the prompt followed by the answer;
- a judge reads reward_model.judge_prompt filled with the prompt, the answer and the reference answer (inside
  its chat template when it has one), answers greedily, and its verdict's first match of
  reward_model.verdict_pattern is the reward; a verdict without one gets reward_model.unparsed_reward.

An input longer than the reward model's context loses its beginning (the answer, at the end, is what is
judged), and is counted. The engine sleeps with the policy's engines while the trainer trains (the controller's
switch): its weights never change, so it sleeps at level 1 and wakes whole.
"""

from __future__ import annotations

import contextlib
import time

import ray


class RewardModel:
    """The job's reward model as a batched reward (rl/scoring.py): the engine actor scores every sample of a
    step in one call. It also switches the engine, for the controller: asleep while the trainer trains."""

    batched = True

    def __init__(self, actor, *, kind: str):
        self.actor, self.kind = actor, kind  # kind "model" or "judge": the component's name, reward_<kind>_mean
        self._stats = self._no_stats()

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
        started = time.perf_counter()
        result = ray.get(self.actor.score.remote(list(prompts), list(responses), list(answers)))
        self._stats["seconds"] += time.perf_counter() - started
        for key in ("num_scored", "num_truncated", "num_unparsed"):
            self._stats[key] += result[key]
        return result["scores"]

    def take_stats(self) -> dict:
        """What was scored since the last call (a step's scoring, its refills included)."""
        stats, self._stats = self._stats, self._no_stats()
        return stats

    @contextlib.contextmanager
    def separate_stats(self):
        """Count what is scored inside the block apart (an evaluation within a step), into the dict it gives."""
        outer, self._stats = self._stats, self._no_stats()
        try:
            yield self._stats
        finally:
            self._stats = outer

    def _no_stats(self) -> dict:
        return {"kind": self.kind, "num_scored": 0, "num_truncated": 0, "num_unparsed": 0, "seconds": 0.0}

    def sleep(self) -> int:
        """Level 1: a host copy of the weights is kept and written back on wake (they are never synced). Returns
        the bytes freed (on the CPU the KV cache's: there the host copy sits in the same memory)."""
        freed = ray.get(self.actor.sleep.remote(1))
        self._stats["sleep_freed_bytes"] = freed
        return freed

    def wake(self) -> int:
        return ray.get(self.actor.wake.remote(["weights", "kv_cache"]))

    def memory(self) -> list[dict]:
        """Each worker's memory (EngineActor.memory)."""
        return ray.get(self.actor.memory.remote())
