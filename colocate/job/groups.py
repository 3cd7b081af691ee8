"""The job's actors as groups: one call fans out to every member and returns when all have answered, so the
controller's phases read as what they do (`trainers.offload()`, `engines.sleep(2)`), not as Ray plumbing.

    trainers = TrainerGroup(actor_handles)        # a list of Ray actor handles, with the group's calls
    trainers.train_step(sequences, cfg.trainer, step=3)   # each rank its share, every rank the same pass count
    engines.sleep(2); engines.wake(["weights"])

A group is a list: code that needs one member (a rank, an engine's worker list) indexes it as before.
"""

from __future__ import annotations

import ray

from colocate.config import TrainerConfig
from colocate.rl.samples import Sequence
from colocate.trainer.batching import deal, trainer_micro_batches
from colocate.trainer.stats import TrainStats


class ActorGroup(list):
    def call(self, method: str, *args, **kwargs) -> list:
        """`method` on every member at once; their results in member order."""
        return ray.get([getattr(actor, method).remote(*args, **kwargs) for actor in self])


class TrainerGroup(ActorGroup):
    """The FSDP2 ranks. Every call is a collective of theirs: all ranks or none."""

    def train_step(self, sequences: list[Sequence], cfg: TrainerConfig, *, step: int, update: int = 0) -> TrainStats:
        """One optimizer step on `sequences`, dealt to the ranks by tokens (trainer/batching.py); every rank runs
        the micro-batch count of the rank with the most (a collective each), grouped as each rank groups its
        own, and the loss aggregates the response tokens of all ranks. No sequences (dynamic sampling kept no
        group): no step at all, not an optimizer step on zero gradients (AdamW's moments would still move)."""
        if not sequences:
            return TrainStats()
        shares = deal(sequences, len(self))
        num_micro_batches = max(len(trainer_micro_batches(share, cfg)) for share in shares)
        num_tokens = sum(s.num_trained_tokens for s in sequences)
        results = ray.get([t.train_step.remote(share, step=step, num_tokens_all_ranks=num_tokens,
                                               num_micro_batches=num_micro_batches,
                                               num_seqs_all_ranks=len(sequences), update=update)
                           for share, t in zip(shares, self)])
        return sum(results, TrainStats())

    def score(self, sequences: list[Sequence], cfg: TrainerConfig, *, temperature: float, top_p: float,
              method: str = "score") -> list:
        """Every sequence's response logprobs under the trainers' current weights (TrainerActor.score, the loss's
        path, no gradient), in the order given. `method` score_routing: each with its routing
        (TrainerActor.score_routing, algo.router_replay)."""
        return self._per_sequence(method, sequences, cfg, temperature=temperature, top_p=top_p)

    def values(self, sequences: list[Sequence], cfg: TrainerConfig) -> list[list[float]]:
        """The critic's value of every response token (algo.advantage=gae: TrainerActor.values), in the order
        given."""
        return self._per_sequence("values", sequences, cfg)

    def _per_sequence(self, method: str, sequences: list[Sequence], cfg: TrainerConfig, **kwargs) -> list:
        """A forward pass of every rank (`method`, no gradient) over `sequences` dealt and micro-batched as
        train_step deals them, every rank running the same micro-batch count: each sequence's result, in order."""
        shares = deal(sequences, len(self))
        num_micro_batches = max(len(trainer_micro_batches(share, cfg)) for share in shares)
        results = ray.get([getattr(t, method).remote(share, num_micro_batches=num_micro_batches, **kwargs)
                           for share, t in zip(shares, self)])
        by_id = {id(s): r for share, rows in zip(shares, results) for s, r in zip(share, rows)}
        return [by_id[id(s)] for s in sequences]

    def offload(self) -> None:
        self.call("offload")

    def onload(self) -> None:
        self.call("onload")

    def release_grads(self) -> None:
        self.call("release_grads")


class EngineGroup(ActorGroup):
    """The vLLM engines (each an actor driving its TP workers), and what sleeps and wakes with them: the reward
    model's engine (rollout.rewards=model:PATH), on their devices, asleep while the trainer trains."""

    def __init__(self, actors=(), *, sleeps_with: list | None = None):
        super().__init__(actors)
        self.sleeps_with = sleeps_with if sleeps_with is not None else []  # each with sleep() and wake()

    def sleep(self, level: int) -> None:
        """The policy's engines at `level`, then the others (the reward model at its own level: docs/rewards)."""
        self.call("sleep", level)
        for other in self.sleeps_with:
            other.sleep()

    def wake(self, tags: list[str]) -> None:
        """The policy's engines' `tags`; the others wake whole with the KV cache, the last thing to return (they
        are never synced: their weights come back for the next step's scoring, and for evaluation)."""
        self.call("wake", tags)
        if "kv_cache" in tags:
            for other in self.sleeps_with:
                other.wake()


def memory_record(engines: EngineGroup, trainers: TrainerGroup, reward_model=None) -> dict:
    """Host RSS summed per side, and on CUDA each actor's device memory (torch's allocated and reserved bytes,
    and the driver's free bytes on its GPU: vLLM's cuMem pool is invisible to torch's counters)."""
    workers = [w for e in engines.call("memory") for w in e]
    ranks = trainers.call("memory")
    record = {"engine_rss_bytes": sum(w["rss_bytes"] for w in workers),
              "trainer_rss_bytes": sum(t["rss_bytes"] for t in ranks)}
    if reward_model is not None:
        record["reward_model_rss_bytes"] = sum(w["rss_bytes"] for w in reward_model.memory())
    if "device_free_bytes" in ranks[0]:
        keys = ("device_allocated_bytes", "device_reserved_bytes", "device_free_bytes")
        record["trainers"] = [{k: t[k] for k in keys} for t in ranks]
        record["engine_workers"] = [{k: w[k] for k in keys} for w in workers]
    return record
