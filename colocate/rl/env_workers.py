"""rollout.env_workers=N: the environments of the episodes in flight live in N Ray actors, so that a slow
environment (a sandbox, a simulator, an HTTP tool) does not hold the engines while the controller steps
every episode one at a time.

    workers = [EnvWorker actors]                 # the runtime starts them (Runtime.env_workers), and kills them
    episodes = RemoteEpisodes(workers, tokenize=..., decode=...)
    episodes.step_many([(key, sample, turn, action), ...])   # one call per worker, the workers in parallel

An episode's environment lives in one worker for its whole life, chosen by its key (group id, answer), so its
state between turns stays where it was made. Each worker holds a plain `Episodes` (rl/environments.py) and
runs its share of a batch one call at a time, each bounded by rollout.env_timeout_s and checked there, exactly
as in the controller's process: an error, a hang or a wrong type comes back as the EnvError naming the sample
and the turn, in its place in the batch. A worker that dies fails every call it had (EnvError naming the worker)
and the environments it held are gone: with rollout.env_errors=drop, their groups are dropped, and the next
calls for them say so.

The workers reserve no CPU (`num_cpus=0`): the slots' bundles hold the node's CPUs for the trainers and
engines, and an environment's work is the host's spare cores' (or its own service's). Observations are
tokenized in the workers, with the policy's tokenizer, and only token ids come back.
"""

from __future__ import annotations

import ray

from colocate.errors import EnvError
from colocate.rl.environments import Turn
from colocate.rl.tasks import Sample

Key = tuple[int, int]


class EnvWorker:
    """A Ray actor holding some episodes' environments (rollout.env), made by the job's factory."""

    def __init__(self, spec: str, *, length: int, model_path: str, timeout_s: float):
        from colocate.models.sources import load_tokenizer
        from colocate.rl.environments import Episodes, make_env_factory

        tokenizer = load_tokenizer(model_path)
        self.episodes = Episodes(make_env_factory(spec, length=length),
                                 tokenize=lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                                 decode=tokenizer.decode, timeout_s=timeout_s)

    def start_many(self, items: list[tuple[Key, Sample]]) -> list:
        return self.episodes.start_many(items)

    def step_many(self, items: list[tuple[Key, Sample, int, str]]) -> list:
        return self.episodes.step_many(items)

    def forget(self, keys: list[Key]) -> None:
        self.episodes.forget(keys)


class RemoteEpisodes:
    """`Episodes`' interface over EnvWorker actors: the rollout pool cannot tell them apart."""

    def __init__(self, workers: list, *, decode):
        assert workers, "rollout.env_workers > 0"
        self.workers, self.decode = workers, decode
        self.envs: dict[Key, int] = {}  # each live episode's worker
        self.lost: set[Key] = set()  # episodes whose worker died

    def worker_of(self, key: Key) -> int:
        return (key[0] * 7919 + key[1]) % len(self.workers)  # a group's answers spread over the workers

    def start(self, key: Key, sample: Sample) -> list[int]:
        return _raised(self.start_many([(key, sample)])[0])

    def step(self, key: Key, sample: Sample, turn: int, action: str) -> Turn:
        return _raised(self.step_many([(key, sample, turn, action)])[0])

    def start_many(self, items: list[tuple[Key, Sample]]) -> list[list[int] | EnvError]:
        self.lost.difference_update(key for key, _ in items)  # a restart makes a new environment
        out = self._fan_out("start_many", items, what="reset")
        self.envs.update((key, self.worker_of(key)) for key, _ in items)
        return out

    def step_many(self, items: list[tuple[Key, Sample, int, str]]) -> list[Turn | EnvError]:
        return self._fan_out("step_many", items, what="step")

    def forget(self, keys) -> None:
        by_worker: dict[int, list[Key]] = {}
        for key in keys:
            if self.envs.pop(key, None) is not None:
                by_worker.setdefault(self.worker_of(key), []).append(key)
            self.lost.discard(key)
        for w, worker_keys in by_worker.items():
            self.workers[w].forget.remote(worker_keys)  # not awaited: the next call to that worker follows it

    def _fan_out(self, method: str, items: list[tuple], *, what: str) -> list:
        """Each worker's share of `items` in one call, all workers at once; the outcomes back in `items`' order."""
        out: list = [None] * len(items)
        shares: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            key, sample = item[0], item[1]
            if key in self.lost:
                out[i] = EnvError(f"environment (rollout.env) {what}: its worker died earlier, with the episode's "
                                  f"environment, on sample {sample.prompt!r} at turn {_turn(item)}")
            else:
                shares.setdefault(self.worker_of(key), []).append(i)
        calls = {w: getattr(self.workers[w], method).remote([items[i] for i in indices])
                 for w, indices in shares.items()}
        for w, ref in calls.items():
            try:
                outcomes = ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the worker died: every episode it held is gone
                self.lost.update(k for k, worker in self.envs.items() if worker == w)
                cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                outcomes = [EnvError(f"environment (rollout.env) {what}: environment worker {w} died ({cause}), on "
                                     f"sample {items[i][1].prompt!r} at turn {_turn(items[i])}")
                            for i in shares[w]]
            for i, outcome in zip(shares[w], outcomes):
                out[i] = outcome
        return out


def _turn(item: tuple) -> int:
    return item[2] if len(item) > 2 else 0


def _raised(outcome):
    if isinstance(outcome, EnvError):
        raise outcome
    return outcome
