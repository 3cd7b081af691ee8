"""Toy tasks, rewards, dotted-path loading and the prompt stream (no model needed)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import pytest

from colocate.models.sources import CHARACTERS
from colocate.rl.tasks import (
    AddTask,
    PromptStream,
    Sample,
    char_match_reward,
    load_reward_fn,
    make_task,
)


@dataclass(frozen=True)
class ConstantTask:
    """A user task for the dotted-path factory test."""

    length: int
    name: str = "constant"

    def sample(self, rng: random.Random) -> Sample:
        return Sample(prompt="a" * self.length + "=", answer="b" * self.length)

    def reward(self, prompt: str, response: str, answer: str) -> float:
        return float(response == answer)


def make_my_task(length: int) -> ConstantTask:
    return ConstantTask(length=length)


def always_half(prompt: str, response: str, answer: str) -> float:
    return 0.5


NOT_CALLABLE = 42


def samples(name: str, length: int, seed: int = 0, count: int = 20) -> list[Sample]:
    return PromptStream(make_task(name, length=length), seed=seed).next_batch(count)


@pytest.mark.parametrize("length", [1, 3, 5])
def test_copy_format(length):
    for sample in samples("copy", length):
        assert re.fullmatch(rf"\d{{{length}}}=", sample.prompt)
        assert sample.answer == sample.prompt[:-1]


@pytest.mark.parametrize("length", [1, 3, 5])
def test_reverse_format(length):
    for sample in samples("reverse", length):
        assert re.fullmatch(rf"\d{{{length}}}=", sample.prompt)
        assert sample.answer == sample.prompt[:-1][::-1]


@pytest.mark.parametrize("length", [1, 3, 5])
def test_add_format(length):
    for sample in samples("add", length, count=200):
        match = re.fullmatch(r"(\d+)\+(\d+)=", sample.prompt)
        assert match
        a, b = match.groups()
        assert len(a) == len(b) == length
        assert sample.answer == str(int(a) + int(b))


def test_add_single_digit_covers_zero():
    operands = {p for s in samples("add", 1, count=500) for p in s.prompt[:-1].split("+")}
    assert operands == set("0123456789")


@pytest.mark.parametrize("name", ["copy", "reverse", "add"])
def test_builtin_uses_model_vocabulary_and_is_deterministic(name):
    first, again = samples(name, 4, seed=7), samples(name, 4, seed=7)
    assert first == again
    assert len(set(first)) > 1  # actually random, not a constant prompt
    for sample in first:
        assert set(sample.prompt + sample.answer) <= set(CHARACTERS)
    assert make_task(name, length=4).name == name


@pytest.mark.parametrize("name", ["copy", "reverse", "add"])
def test_builtin_reward_exact_empty_partial(name):
    task = make_task(name, length=3)
    sample = task.sample(random.Random(1))
    assert task.reward(sample.prompt, sample.answer, sample.answer) == 1.0
    assert task.reward(sample.prompt, "", sample.answer) == 0.0
    partial = task.reward(sample.prompt, sample.answer[:-1], sample.answer)
    assert 0.0 < partial < 1.0


def test_char_match_reward_formula():
    assert char_match_reward("123=", "123", "123") == 1.0
    assert char_match_reward("123=", "", "123") == 0.0
    assert char_match_reward("123=", "12", "123") == pytest.approx(2 / 3)  # one missing
    assert char_match_reward("123=", "1x3", "123") == pytest.approx(2 / 3)  # one wrong
    assert char_match_reward("123=", "1234", "123") == pytest.approx(3 / 4)  # one extra
    assert char_match_reward("123=", "123456", "123") == pytest.approx(3 / 6)  # rambling costs more
    assert char_match_reward("123=", "xyz", "123") == 0.0
    assert char_match_reward("=", "", "") == 1.0


def test_reward_always_in_unit_interval():
    rng = random.Random(0)
    alphabet = "".join(CHARACTERS)
    for _ in range(500):
        response = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        answer = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6)))
        assert 0.0 <= char_match_reward("", response, answer) <= 1.0


@pytest.mark.parametrize("bad", ["copx", "", "no_such_module_xyz:factory", "tests.unit.test_tasks:missing",
                                 "tests.unit.test_tasks", "tests.unit.test_tasks:NOT_CALLABLE"])
def test_make_task_bad_spec(bad):
    with pytest.raises(ValueError) as info:
        make_task(bad, length=3)
    message = str(info.value)
    assert f"rollout.task={bad!r}" in message
    assert "add, copy, reverse" in message
    assert "\n" not in message


def test_make_task_dotted_path_factory():
    task = make_task("tests.unit.test_tasks:make_my_task", length=2)
    assert isinstance(task, ConstantTask)
    assert task.length == 2
    assert task.sample(random.Random(0)) == Sample(prompt="aa=", answer="bb")


def test_load_reward_fn():
    reward_fn = load_reward_fn("tests.unit.test_tasks:always_half")
    assert reward_fn("1=", "1", "1") == 0.5


@pytest.mark.parametrize("bad", ["nonsense", "no_such_module_xyz:f", "tests.unit.test_tasks:missing",
                                 "tests.unit.test_tasks:NOT_CALLABLE"])
def test_load_reward_fn_bad_path(bad):
    with pytest.raises(ValueError) as info:
        load_reward_fn(bad)
    assert f"rollout.reward_fn={bad!r}" in str(info.value)


def test_prompt_stream_seeds():
    task = AddTask(length=3)
    stream_a, stream_b, other = PromptStream(task, seed=3), PromptStream(task, seed=3), PromptStream(task, seed=4)
    batches_a = [stream_a.next_batch(8) for _ in range(3)]
    batches_b = [stream_b.next_batch(8) for _ in range(3)]
    assert batches_a == batches_b
    assert batches_a[0] != batches_a[1]  # the stream advances
    assert [other.next_batch(8) for _ in range(3)] != batches_a
    assert all(len(batch) == 8 for batch in batches_a)


def test_prompt_stream_ignores_global_random():
    task = make_task("copy", length=4)
    expected = PromptStream(task, seed=0).next_batch(5)
    stream = PromptStream(task, seed=0)
    random.seed(123)
    random.random()
    assert stream.next_batch(5) == expected
