"""rollout.env_workers=N: the environments of the episodes in flight live in N Ray actors, so that a slow
environment (a sandbox, a simulator, an HTTP tool) does not hold the engines while the controller steps
every episode one at a time.

    workers = [EnvWorker actors]                 # the runtime starts them (Runtime.env_workers), and kills them
    episodes = RemoteEpisodes(workers, decode=tokenizer.decode)
    episodes.step_many([(key, sample, turn, action), ...])   # one call per worker, the workers in parallel

An episode's environment lives in one worker for its whole life, chosen by its key (group id, answer), so its
state between turns stays where it was made. Each worker holds a plain `Episodes` (rollout/environments.py) and
runs its share of a batch one call at a time, each bounded by rollout.env_timeout_s and checked there, exactly
as in the controller's process: an error, a hang or a wrong type comes back as the EnvError naming the sample
and the turn, in its place in the batch. A worker that dies fails every call it had (EnvError naming the worker)
and the environments it held are gone: with rollout.env_errors=drop, their groups are dropped, the next calls for
them say so, and new episodes go to the workers left.

The workers reserve no CPU (`num_cpus=0`): the slots' bundles hold the node's CPUs for the trainers and
engines, and an environment's work is the host's spare cores' (or its own service's). Observations are
tokenized in the workers, with the policy's tokenizer, and only token ids come back.
"""

from __future__ import annotations

import ray

from colocate.errors import EnvError
from colocate.rollout.environments import Turn
from colocate.rl.tasks import Sample

Key = tuple[int, int]


class EnvWorker:
    """A Ray actor holding some episodes' environments (rollout.env), made by the job's factory."""

    def __init__(self, spec: str, *, length: int, model_path: str, timeout_s: float):
        from colocate.models.sources import load_tokenizer
        from colocate.rollout.environments import Episodes, make_env_factory

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
        self.dead: set[int] = set()  # workers that died: new episodes go to the others

    def worker_of(self, key: Key) -> int | None:
        """The worker of an episode: where it lives, or for a new one a live worker chosen by its key (a group's
        answers spread over the workers); None when every worker died."""
        if key in self.envs:
            return self.envs[key]
        live = [w for w in range(len(self.workers)) if w not in self.dead]
        return live[(key[0] * 7919 + key[1]) % len(live)] if live else None

    def start(self, key: Key, sample: Sample) -> list[int]:
        return _raised(self.start_many([(key, sample)])[0])

    def step(self, key: Key, sample: Sample, turn: int, action: str) -> Turn:
        return _raised(self.step_many([(key, sample, turn, action)])[0])

    def start_many(self, items: list[tuple[Key, Sample]]) -> list[list[int] | EnvError]:
        for key, _ in items:  # a (re)start makes a new environment, on a live worker chosen now
            self.lost.discard(key)
            self.envs.pop(key, None)
            if (w := self.worker_of(key)) is not None:
                self.envs[key] = w
        out = self._fan_out("start_many", items, what="reset")
        for (key, _), outcome in zip(items, out):
            if isinstance(outcome, EnvError):  # no environment was made (or its worker died making it)
                self.envs.pop(key, None)
                self.lost.discard(key)
        return out

    def step_many(self, items: list[tuple[Key, Sample, int, str]]) -> list[Turn | EnvError]:
        return self._fan_out("step_many", items, what="step")

    def forget(self, keys) -> None:
        by_worker: dict[int, list[Key]] = {}
        for key in keys:
            w = self.envs.pop(key, None)
            if w is not None and w not in self.dead:
                by_worker.setdefault(w, []).append(key)
            self.lost.discard(key)
        for w, worker_keys in by_worker.items():
            self.workers[w].forget.remote(worker_keys)  # not awaited: the next call to that worker follows it

    def _fan_out(self, method: str, items: list[tuple], *, what: str) -> list:
        """Each worker's share of `items` in one call, all workers at once; the outcomes back in `items`' order."""
        out: list = [None] * len(items)
        shares: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            key, sample = item[0], item[1]
            w = self.worker_of(key)
            if key in self.lost or w is None:
                why = "its worker died earlier, with the episode's environment" if key in self.lost else \
                    f"every one of the {len(self.workers)} environment workers died"
                out[i] = EnvError(f"environment (rollout.env) {what}: {why}, on sample {sample.prompt!r} at turn "
                                  f"{_turn(item)}")
            else:
                shares.setdefault(w, []).append(i)
        calls = {w: getattr(self.workers[w], method).remote([items[i] for i in indices])
                 for w, indices in shares.items()}
        for w, ref in calls.items():
            try:
                outcomes = ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the worker died: every episode it held is gone
                self.dead.add(w)
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
