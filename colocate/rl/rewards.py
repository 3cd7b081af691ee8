"""Built-in rewards for data with reference answers, and their weighted sums (`rollout.rewards`).

    reward = make_reward(cfg, task)            # rollout.rewards, else rollout.reward_fn, else task.reward
    combined = CombinedReward(parse_rewards("math:1.0,format:0.1"))
    combined(["2+2="], ["answer: 4"], ["4"])
    # RewardBreakdown(total=[1.1], components={"math": [1.0], "format": [1.0]})

Built-ins (each `f(prompt, response, answer) -> float`):

- ``math``:   1.0 when the response's final answer equals the reference. The final answer is the last
  ``\\boxed{...}``, else the number after the last "answer:", else the last number in the response. Compared with
  math-verify when it is installed (so 0.5, 1/2 and \\frac{1}{2} are equal), else as exact rationals.
- ``exact``:  1.0 when the stripped response equals the stripped answer.
- ``format``: 1.0 when the response gives a final answer in a form ``math`` reads on purpose: a non-empty
  ``\\boxed{...}`` or "answer: <number>"; a bare last number does not count.
- ``char``:   the toy tasks' dense character match (`tasks.char_match_reward`), partial credit a tiny model can
  climb before it ever gets an answer exactly right.

And a reward model the job serves (rollout/reward_model.py): ``model:PATH`` (a sequence classifier) or ``judge:PATH``
(a generative judge), logged as ``reward_model_mean`` or ``reward_judge_mean``. The runtime starts its engine;
`make_reward` binds it to the component.

`score()` logs each component's unweighted mean as `reward_<name>_mean` beside the weighted total's
`reward_mean`. A weight of 0 keeps a component in the metrics without training on it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from colocate.config import JobConfig
from colocate.config.reward_model import reward_model_spec
from colocate.errors import ConfigError
from colocate.rl.scoring import Reward, RewardBreakdown, apply_reward
from colocate.rl.plugins import import_object
from colocate.rl.tasks import Task, char_match_reward, load_reward_fn

log = logging.getLogger("colocate")

# A number as people write one: 1,000 / -3 / 0.5 / .5 / 1/2 (thousands separators only in groups of three, so that
# "3,4" stays two numbers).
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?")
_ANSWER = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*(" + _NUMBER.pattern + ")", re.IGNORECASE)
_FORMAT = re.compile(r"answer\s*:\s*" + _NUMBER.pattern, re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces may nest), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unclosed: the response was cut off inside the box


def final_answer(response: str) -> str | None:
    """The answer a response commits to: last \\boxed{}, else the number after the last "answer:", else the
    last number; None when it has none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    stated = _ANSWER.findall(response)
    if stated:
        return stated[-1]
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _as_fraction(text: str) -> Fraction | None:
    text = text.strip().strip("$").replace(",", "").strip()
    try:
        return Fraction(text)  # reads "3", "-0.5", "1/2", "1e3"
    except (ValueError, ZeroDivisionError):
        return None


@functools.lru_cache(maxsize=1)
def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError:
        log.info("math-verify is not installed: the math reward compares numbers exactly")
        return None
    return parse, verify


@functools.lru_cache(maxsize=4096)
def _parsed_gold(answer: str, timeout: int | None):
    parse, _ = _math_verify()
    return parse(answer, parsing_timeout=timeout)


def answers_equal(predicted: str, answer: str) -> bool:
    """math-verify's equivalence when installed (and it parses both), else equal rationals, else equal text."""
    mv = _math_verify()
    if mv is not None:
        parse, verify = mv
        # math-verify's timeouts are SIGALRM handlers, which only the main thread may install
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        gold, pred = _parsed_gold(answer, timeout), parse(predicted, parsing_timeout=timeout)
        if gold and pred:
            return bool(verify(gold, pred, timeout_seconds=timeout))
    a, b = _as_fraction(predicted), _as_fraction(answer)
    if a is not None and b is not None:
        return a == b
    return predicted.strip() == answer.strip()


def math_reward(prompt: str, response: str, answer: str) -> float:
    predicted = final_answer(response)
    return float(predicted is not None and answers_equal(predicted, answer))


def exact_reward(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


def format_reward(prompt: str, response: str, answer: str) -> float:
    boxed = last_boxed(response)
    return float(bool(boxed and boxed.strip()) or bool(_FORMAT.search(response)))


BUILTIN_REWARDS: dict[str, Callable[[str, str, str], float]] = {
    "math": math_reward, "exact": exact_reward, "format": format_reward, "char": char_match_reward}
_VALID = (f"valid: comma-separated name[:weight] with names {', '.join(BUILTIN_REWARDS)}, module:function, "
          "model:PATH or judge:PATH")


@dataclass(frozen=True)
class Component:
    name: str  # as in the metrics: reward_<name>_mean
    fn: Reward | None  # None: a reward model's, bound by make_reward to the engine the runtime started
    weight: float
    model_path: str = ""  # model:PATH or judge:PATH: the reward model's PATH


def parse_rewards(spec: str, *, key: str = "rollout.rewards") -> list[Component]:
    """"math:1.0,format:0.1,my_pkg.rewards:brevity:0.5" -> components. A trailing ":<number>" is the weight
    (default 1); what is left is a built-in name or a module:function. Raises ConfigError naming `key`."""
    components: list[Component] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            raise ConfigError(f"{key}={spec!r} is invalid: an empty component; {_VALID}")
        if (model := reward_model_spec(item)) is not None:  # JobConfig.check refused a second one
            components.append(Component(model.kind, None, model.weight, model_path=model.path))
            continue
        head, colon, tail = item.rpartition(":")
        weight = _weight(tail) if colon else None
        if weight is None and head in BUILTIN_REWARDS:
            raise ConfigError(f"{key}={spec!r} is invalid: the weight of {head!r} is {tail!r}, not a "
                              "number")
        name = head if weight is not None else item
        weight = 1.0 if weight is None else weight
        if name in BUILTIN_REWARDS:
            fn = BUILTIN_REWARDS[name]
        elif ":" in name:
            fn = import_object(name, key, _VALID)
            name = name.rpartition(":")[2]
        else:
            raise ConfigError(f"{key}={spec!r} is invalid: unknown reward {name!r}; {_VALID}")
        if any(c.name == name for c in components):
            raise ConfigError(f"{key}={spec!r} is invalid: {name!r} is listed twice; give it one weight")
        components.append(Component(name, fn, weight))
    return components


def _weight(text: str) -> float | None:
    try:
        weight = float(text)
    except ValueError:
        return None
    if not math.isfinite(weight):
        raise ConfigError(f"rollout.rewards weight {text!r} is invalid: must be a finite number")
    return weight


class CombinedReward:
    """The weighted sum of the components, batched so that each component's values come back for the metrics."""

    batched = True

    def __init__(self, components: list[Component]):
        self.components = components

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str]) -> RewardBreakdown:
        total = [0.0] * len(prompts)
        parts: dict[str, list[float]] = {}
        for c in self.components:
            # each component is checked on its own, so a bad value names the reward that returned it
            values, _ = apply_reward(c.fn, prompts, responses, answers, name=f"reward {c.name!r}")
            parts[c.name] = values
            total = [t + c.weight * v for t, v in zip(total, values)]
        return RewardBreakdown(total, parts)


def make_reward(cfg: JobConfig, task: Task, reward_model=None) -> Reward:
    """The job's reward: rollout.rewards (weighted built-ins, plug-ins and the reward model, `reward_model`: the
    runtime's rollout.reward_model.RewardModel), else rollout.reward_fn, else the task's own reward; the last two
    unchanged, so a job without rollout.rewards scores as before."""
    if cfg.rollout.source_rewards:  # each row's source picks its rewards
        return SourceRewards.from_config(cfg)
    if cfg.rollout.rewards:
        components = parse_rewards(cfg.rollout.rewards)
        for i, c in enumerate(components):
            if c.fn is None:
                assert reward_model is not None and reward_model.kind == c.name, "the runtime serves the model"
                components[i] = Component(c.name, reward_model, c.weight, c.model_path)
        return CombinedReward(components)
    if cfg.rollout.reward_fn:
        return load_reward_fn(cfg.rollout.reward_fn)
    return task.reward


# ------------------------------------------------------------------------------------------ per-source rewards
# rollout.source_rewards: each data row's source (its data.source_key column, verl's `data_source`) picks the
# rewards that score its answers, so one job can train on math and on code, each scored its own way, and report
# each apart:
#
#     rollout.source_rewards='{"gsm8k": "math:1.0,format:0.1", "aime": "math", "*": "exact"}'
#     values, parts = apply_reward(reward.for_sources(sources), prompts, responses, answers)
#
# Each value is a rollout.rewards spec (built-ins and module:function plug-ins, weighted); "*" scores every source
# not listed. A source with no entry and no "*" is refused, naming it, when the data is read (before any actor).
# A component's values are NaN on the answers of sources it does not score: the metrics average each over the
# answers it scored (rl/scoring.py `defined_mean`). A reward model (model:PATH, judge:PATH) serves rollout.rewards
# only.

SOURCE_KEY = "rollout.source_rewards"
ANY = "*"


def parse_source_rewards(text: str) -> dict[str, CombinedReward]:
    """The JSON object of rollout.source_rewards as each source's reward; one line naming the key otherwise."""
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{SOURCE_KEY}={text!r} is invalid: not a JSON object ({e.msg}); e.g. "
                          '{"gsm8k": "math", "*": "exact"}') from None
    if not isinstance(specs, dict) or not specs or not all(isinstance(v, str) for v in specs.values()):
        raise ConfigError(f"{SOURCE_KEY}={text!r} is invalid: expected a JSON object of source -> rollout.rewards "
                          'spec, e.g. {"gsm8k": "math", "*": "exact"}')
    out = {}
    for source, spec in specs.items():
        components = parse_rewards(spec, key=f"{SOURCE_KEY}[{source!r}]")
        if any(c.fn is None for c in components):
            raise ConfigError(f"{SOURCE_KEY}[{source!r}]={spec!r} is invalid: a reward model serves rollout.rewards "
                              "only; valid here: built-ins and module:function rewards")
        out[source] = CombinedReward(components)
    return out


def check_covered(sources: Sequence[str], rewards: dict, *, key: str) -> None:
    """Every source of the rows read for `key` (data.train_files, data.val_files) has its reward, or "*" does."""
    if ANY in rewards:
        return
    missing = sorted({s for s in sources if s not in rewards})
    if missing:
        raise ConfigError(f"{SOURCE_KEY} is invalid for {key}: its rows' source {missing[0]!r} has no reward (sources "
                          f"without one: {', '.join(map(repr, missing))}); give it one, or a \"*\" entry for every "
                          "other source")


class SourceRewards:
    by_source = True

    def __init__(self, rewards: dict[str, CombinedReward]):
        self.rewards = rewards

    @classmethod
    def from_config(cls, cfg: JobConfig) -> SourceRewards:
        return cls(parse_source_rewards(cfg.rollout.source_rewards))

    def reward_of(self, source: str) -> CombinedReward:
        assert source in self.rewards or ANY in self.rewards, f"source {source!r} has no reward: checked on read"
        return self.rewards.get(source) or self.rewards[ANY]

    def primary(self, source: str) -> str:
        """The component that says whether an answer of `source` is right: its spec's first (evaluation)."""
        return self.reward_of(source).components[0].name

    def for_sources(self, sources: Sequence[str]):
        """A batched reward over samples whose sources are `sources`, in order."""

        def reward(prompts: list[str], responses: list[str], answers: list[str]) -> RewardBreakdown:
            total, parts = [0.0] * len(prompts), {}
            for source in dict.fromkeys(sources):
                idx = [i for i, s in enumerate(sources) if s == source]
                values, components = apply_reward(self.reward_of(source), [prompts[i] for i in idx],
                                                  [responses[i] for i in idx], [answers[i] for i in idx],
                                                  name=f"reward of source {source!r}")
                for i, v in zip(idx, values):
                    total[i] = v
                for name, part in components.items():
                    column = parts.setdefault(name, [math.nan] * len(prompts))
                    for i, v in zip(idx, part):
                        column[i] = v
            return RewardBreakdown(total, parts)

        reward.batched = True
        return reward
