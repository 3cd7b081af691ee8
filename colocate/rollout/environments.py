"""Multi-turn environments: an answer becomes an episode of turns, the model's and the environment's.

    env = make_env_factory("copy_turns", length=3)()       # or "my_pkg.envs:make" (rollout.env)
    prompt = env.reset(sample)                             # the episode's first prompt: text or token ids
    observation, reward, done = env.step(action_text)      # after each turn of the model

The protocol (docs/environments.md): `reset(sample) -> str | list[int]` and `step(action) -> (observation,
reward, done)`, where `observation` is text or token ids, `reward` a finite number and `done` a bool. Either may be
`async def`. One environment object per answer: a group's answers are independent episodes from the same prompt,
so `reset` must give every one of them the same prompt (it may depend on the sample only).

Tokens in, tokens out: the rollout pool appends the engine's tokens and the observation's tokens to the answer as
they come, and sends the whole answer back as the next turn's prompt. Nothing is re-tokenised, so what the trainer
sees is exactly what the engine sampled; the observation's tokens carry a mask of 0 (no loss, no log-prob).

An environment is user code: `Episodes` calls it with a time bound (rollout.env_timeout_s) and checks what it
returns. A call that raises, hangs or returns the wrong type becomes `EnvError` naming the sample and the
turn; the pool fails the step with it or drops the group (rollout.env_errors). A hung call's thread cannot be
killed: it is abandoned (a daemon thread), and its environment object is never called again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from colocate.errors import EnvError
from colocate.rl.plugins import import_object
from colocate.rl.tasks import DIGITS, Sample, char_match_reward


class Environment(Protocol):
    def reset(self, sample: Sample) -> str | list[int]: ...

    def step(self, action: str) -> tuple[str | list[int], float, bool]: ...


_thread_state = threading.local()


@dataclass
class Turn:
    observation: list[int]
    reward: float
    done: bool


class CopyTurns:
    """The shipped toy: every turn shows digits followed by "=", and the model must write them back (the copy
    task, `length` digits). The reward of a turn is its character match (rl/tasks.py); the episode ends after
    `num_turns` turns. The observation after a turn is the next turn's digits: the model must read what the
    environment said, not only the prompt. Deterministic in the sample, so a resumed run replays it exactly."""

    def __init__(self, length: int = 3, num_turns: int = 2):
        self.length, self.num_turns = length, num_turns
        self.targets: list[str] = []

    def reset(self, sample: Sample) -> str:
        rng = random.Random(sample.prompt)
        first = sample.prompt[:-1] if sample.prompt.endswith("=") else sample.prompt
        self.targets = [first] + ["".join(rng.choice(DIGITS) for _ in range(self.length))
                                  for _ in range(self.num_turns - 1)]
        self.turn = 0
        return f"{first}="

    def step(self, action: str) -> tuple[str, float, bool]:
        reward = char_match_reward("", action, self.targets[self.turn])
        self.turn += 1
        done = self.turn >= self.num_turns
        return ("" if done else f"{self.targets[self.turn]}="), reward, done


def _calculator(length: int):
    from colocate.rollout.tools import Calculator

    return Calculator()


# name -> a factory of the toy task's operand length (rollout.task_length)
BUILTIN_ENVS: dict[str, Callable[[int], Any]] = {"copy_turns": lambda length: CopyTurns(length=length),
                                                 "calculator": _calculator}


def make_env_factory(spec: str, *, length: int) -> Callable[[], Any]:
    """A zero-argument factory of environment objects: a built-in name (given rollout.task_length) or
    `module:factory`. ConfigError names rollout.env when it cannot be imported or called."""
    if spec in BUILTIN_ENVS:
        builtin = BUILTIN_ENVS[spec]
        return lambda: builtin(length)
    factory = import_object(spec, "rollout.env", f"valid: {', '.join(sorted(BUILTIN_ENVS))}, or module:factory")
    return factory


class Episodes:
    """Calls into the environments of the answers in flight, bounded and checked. Keyed by (group id, answer)."""

    def __init__(self, factory: Callable[[], Any], *, tokenize: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], timeout_s: float):
        self.factory, self.tokenize, self.decode, self.timeout_s = factory, tokenize, decode, timeout_s
        self.envs: dict[tuple[int, int], Any] = {}
        # one worker: environments are called one at a time, as the pool applies results in order; a hung call
        # leaves the pool a new worker for the next (the old one stays blocked in the abandoned call)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colocate-env")

    def start(self, key: tuple[int, int], sample: Sample) -> list[int]:
        """A new environment for answer `key`, reset: its prompt's token ids."""
        env = self._call(self.factory, sample, 0, "the factory")
        self.envs[key] = env
        prompt = self._call(env.reset, sample, 0, "reset", sample)
        return self._tokens(prompt, sample, 0, "reset")

    def step(self, key: tuple[int, int], sample: Sample, turn: int, action: str) -> Turn:
        got = self._call(self.envs[key].step, sample, turn, "step", action)
        if not (isinstance(got, tuple) and len(got) == 3):
            raise self._error(sample, turn, f"step returned {_shown(got)}; expected a tuple (observation, reward, "
                                            "done)")
        observation, reward, done = got
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise self._error(sample, turn, f"step returned reward {reward!r}; expected a finite number")
        if not isinstance(done, bool):
            raise self._error(sample, turn, f"step returned done {done!r}; expected True or False")
        return Turn(self._tokens(observation, sample, turn, "step"), float(reward), done)

    def start_many(self, items: list[tuple[tuple[int, int], Sample]]) -> list[list[int] | EnvError]:
        """`start` for each (key, sample), one at a time; a failure comes back as its EnvError, in its place."""
        return [_outcome(self.start, *item) for item in items]

    def step_many(self, items: list[tuple[tuple[int, int], Sample, int, str]]) -> list[Turn | EnvError]:
        """`step` for each (key, sample, turn, action), one at a time; a failure comes back as its EnvError."""
        return [_outcome(self.step, *item) for item in items]

    def forget(self, keys) -> None:
        for key in keys:
            self.envs.pop(key, None)

    def _tokens(self, value, sample: Sample, turn: int, what: str) -> list[int]:
        if isinstance(value, str):
            return self.tokenize(value) if value else []
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        noun = "a prompt" if what == "reset" else "an observation"
        raise self._error(sample, turn, f"{what} returned {_shown(value)} as {noun}; expected text or a list of "
                                        "token ids")

    def _call(self, fn, sample: Sample, turn: int, what: str, *args):
        def run():
            result = fn(*args)
            if not inspect.isawaitable(result):
                return result
            # one event loop per worker thread, kept: what an async environment binds to its loop in reset (a
            # client session) still works in step
            loop = getattr(_thread_state, "loop", None)
            if loop is None:
                loop = _thread_state.loop = asyncio.new_event_loop()
            return loop.run_until_complete(result)

        future = self._pool.submit(run)
        try:
            return future.result(timeout=self.timeout_s or None)
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)  # the hung call keeps its thread; the next call gets a new one
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="colocate-env")
            raise self._error(sample, turn, f"{what} took more than rollout.env_timeout_s={self.timeout_s:g} s") \
                from None
        except EnvError:
            raise
        except Exception as e:  # user code: any exception is the environment's
            raise self._error(sample, turn, f"{what} raised {type(e).__name__}: {e}") from None

    @staticmethod
    def _error(sample: Sample, turn: int, what: str) -> EnvError:
        return EnvError(f"environment (rollout.env) {what}, on sample {sample.prompt!r} at turn {turn}")


def _outcome(call, *args):
    try:
        return call(*args)
    except EnvError as e:
        return e


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def check_env(spec: str, sample: Sample, *, length: int, timeout_s: float) -> None:
    """Before any actor starts: build one environment, reset it on `sample` and step it once with an empty action,
    checking what each returns. ConfigError names rollout.env and what went wrong."""
    from colocate.errors import ConfigError

    episodes = Episodes(make_env_factory(spec, length=length), tokenize=lambda text: [0] * len(text),
                        decode=lambda tokens: "", timeout_s=timeout_s)
    try:
        episodes.start((0, 0), sample)
        episodes.step((0, 0), sample, 0, "")
    except EnvError as e:
        raise ConfigError(f"rollout.env={spec!r} is invalid: {e}") from None
