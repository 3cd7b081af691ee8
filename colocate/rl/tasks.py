"""Toy RL tasks for the character-vocabulary models: prompts, reference answers and dense rewards.

A task turns a random generator into a (prompt, answer) pair and scores a model's response against the
answer. The built-ins use only characters of `colocate.models.sources.CHARACTERS`, so the embedded models can
read and write them:

- ``copy``:    ``"4071="``      -> ``"4071"``
- ``reverse``: ``"4071="``      -> ``"1704"``
- ``add``:     ``"407+215="``   -> ``"622"``

Usage:

    >>> task = make_task("reverse", length=3)
    >>> stream = PromptStream(task, seed=0)
    >>> batch = stream.next_batch(16)                     # list[Sample], the same for the same seed
    >>> task.reward("123=", "32", "321")                     # 2 of 3 characters right, 1 missing
    0.666...
    >>> task.reward("123=", "3210", "321")                   # right, then 1 extra character
    0.75
    >>> reward_fn = load_reward_fn("my_pkg.rewards:score")  # optional override of task.reward

Rewards are dense (partial credit per character, see `char_match_reward`) because a tiny randomly
initialised model almost never emits an exact answer early on; with 0/1 rewards every GRPO group would
score the same and carry no learning signal.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from colocate.rl.plugins import import_object

DIGITS = "0123456789"


@dataclass(frozen=True)
class Sample:
    prompt: str
    """Text given to the model, e.g. "123="."""
    answer: str
    """Reference answer, e.g. "123"."""
    source: str = ""
    """The row's source (data.source_key: verl's data_source), which picks its rewards (rollout.source_rewards) and
    names its metrics; empty: one source."""


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Sample: ...

    def reward(self, prompt: str, response: str, answer: str) -> float:
        """Score in [0, 1] of `response` (generated text without the EOS token) against `answer`."""
        ...


RewardFn = Callable[[str, str, str], float]


def char_match_reward(prompt: str, response: str, answer: str) -> float:
    """Position-wise character match with a length penalty, in [0, 1].

        reward = sum(response[i] == answer[i] for i < min(len(response), len(answer)))
                 / max(len(response), len(answer))

    An exact answer scores 1.0 and an empty response 0.0. Dividing by the longer length makes every
    missing or extra character cost as much as a wrong one, so the model cannot gain by rambling on
    instead of stopping. `prompt` is unused; it is part of the reward signature for custom rewards.
    """
    longest = max(len(response), len(answer))
    if longest == 0:  # both empty: nothing was asked and nothing was said
        return 1.0
    matches = sum(got == want for got, want in zip(response, answer))
    return matches / longest


def _random_digits(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(DIGITS) for _ in range(length))


class _CharMatchReward:
    def reward(self, prompt: str, response: str, answer: str) -> float:
        return char_match_reward(prompt, response, answer)


@dataclass(frozen=True)
class CopyTask(_CharMatchReward):
    """Prompt "<digits>=", answer the same digits."""

    length: int
    name: str = "copy"

    def sample(self, rng: random.Random) -> Sample:
        digits = _random_digits(rng, self.length)
        return Sample(prompt=f"{digits}=", answer=self.answer_for(digits))

    def answer_for(self, digits: str) -> str:
        return digits


@dataclass(frozen=True)
class ReverseTask(CopyTask):
    """Prompt "<digits>=", answer the digits reversed."""

    name: str = "reverse"

    def answer_for(self, digits: str) -> str:
        return digits[::-1]


@dataclass(frozen=True)
class AddTask(_CharMatchReward):
    """Prompt "<a>+<b>=", answer str(a + b); a and b have exactly `length` digits (no leading zeros)."""

    length: int
    name: str = "add"

    def sample(self, rng: random.Random) -> Sample:
        # Length 1 starts at 0 so single-digit sums include the zero operand; longer operands start at
        # 10**(length-1) so that the prompt really has `length` digits without leading zeros.
        low = 0 if self.length == 1 else 10 ** (self.length - 1)
        high = 10**self.length - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        return Sample(prompt=f"{a}+{b}=", answer=str(a + b))


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {"copy": CopyTask, "reverse": ReverseTask, "add": AddTask}
_VALID_TASKS = f"valid: {', '.join(sorted(BUILTIN_TASKS))}, or module:factory"


def make_task(spec: str, *, length: int) -> Task:
    """A built-in task by name ("copy", "reverse", "add"), or `factory(length=length)` for "module:factory".

    Raises ConfigError (a ValueError) naming `rollout.task` for an unknown name or an unimportable path.
    """
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec](length=length)
    return import_object(spec, "rollout.task", _VALID_TASKS)(length=length)


def load_reward_fn(spec: str) -> RewardFn:
    """The function `reward(prompt, response, answer) -> float` at "module.sub:function".

    Raises ConfigError (a ValueError) naming `rollout.reward_fn` if it cannot be imported or is not callable.
    """
    return import_object(spec, "rollout.reward_fn", "valid: module:function(prompt, response, answer) -> float")


class PromptStream:
    """Deterministic stream of prompt batches: PromptStream(task, seed=0).next_batch(num_prompts) -> list[Sample].

    The same task, seed and sequence of `next_batch` sizes give the same batches, so a run's prompts can
    be reproduced from its config alone.
    """

    def __init__(self, task: Task, seed: int = 0) -> None:
        self.task = task
        # A private generator: other users of the global `random` module cannot shift the stream.
        self._rng = random.Random(seed)

    def next_batch(self, num_prompts: int) -> list[Sample]:
        return [self.task.sample(self._rng) for _ in range(num_prompts)]

    def state(self) -> dict:
        version, internal, gauss = self._rng.getstate()
        return {"task": self.task.name, "rng": [version, list(internal), gauss]}

    def load_state(self, state: dict) -> None:
        if state.get("task") != self.task.name:
            raise ValueError(f"prompt stream state is of task {state.get('task')!r}, this job's is {self.task.name!r}")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
