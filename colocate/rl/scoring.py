"""Score rollouts and turn rewards into group-relative (GRPO) advantages.

    groups = [Rollout(sample, prompt_ids, answers), ...]          # rl/samples.py, from the rollout pool
    scored = score(groups, reward_fn=task.reward, decode=tokenizer.decode, eos_id=2, normalize=True)
    scored.sequences   # rl.samples.Sequence: prompt_ids, response_ids, logprobs, advantage

A reward function is user code: when it raises, or returns something that is not a finite number, `RewardError`
names the prompt and response that broke it, so the controller can report the step and stop cleanly instead of
losing the run to a bare traceback (or training on NaN advantages).

A reward is per sample, `f(prompt, response, answer) -> float`, or batched: a callable with the attribute
`batched = True` and the signature `f(prompts, responses, answers) -> list[float]` (one call per step, for
rewards that are cheaper in bulk: a model, a sandbox). A batched reward may return a `RewardBreakdown` instead of a
list: its components' means are logged as `reward_<name>_mean` (rl.rewards' weighted sums do this).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from colocate.errors import RewardError
from colocate.rl.samples import Rollout
from colocate.rl.samples import Sequence as TrainSequence


@dataclass
class RewardBreakdown:
    """What a batched reward may return: each sample's total and, per named component, each sample's value."""

    total: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)


Reward = Callable  # per-sample (prompt, response, answer) -> float, or batched (see the module docstring)


@dataclass
class Scored:
    sequences: list[TrainSequence]
    rewards: list[float]
    responses: list[str] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)  # per named reward, when it has parts

    def stats(self) -> dict:
        num_tokens = [len(s.response_ids) for s in self.sequences]
        return {
            "reward_mean": statistics.fmean(self.rewards),
            "reward_std": statistics.pstdev(self.rewards),
            "reward_min": min(self.rewards),
            "reward_max": max(self.rewards),
            **{f"reward_{name}_mean": statistics.fmean(values) for name, values in self.components.items()},
            "response_len_mean": statistics.fmean(num_tokens),
            "num_response_tokens": sum(num_tokens),
        }


def apply_reward(reward_fn: Reward, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str], *,
                 name: str = "reward function") -> tuple[list[float], dict[str, list[float]]]:
    """Each sample's reward and the components (empty unless a batched reward returned a RewardBreakdown).

    Raises RewardError naming the sample whose reward raised or is not a finite number."""
    if not getattr(reward_fn, "batched", False):
        values = []
        for prompt, response, answer in zip(prompts, responses, answers):
            try:
                value = reward_fn(prompt, response, answer)
            except RewardError:
                raise
            except Exception as e:
                raise RewardError(f"{name} raised {type(e).__name__}: {e} on prompt {prompt!r}, response "
                                  f"{response!r}") from e
            values.append(_finite(value, name, prompt, response))
        return values, {}
    try:
        out = reward_fn(list(prompts), list(responses), list(answers))
    except RewardError:
        raise
    except Exception as e:
        raise RewardError(f"batched {name} raised {type(e).__name__}: {e} on {len(prompts)} samples, the first "
                          f"prompt {prompts[0]!r}, response {responses[0]!r}") from e
    total, components = (out.total, out.components) if isinstance(out, RewardBreakdown) else (out, {})
    if isinstance(total, (str, bytes)) or not hasattr(total, "__len__") or len(total) != len(prompts):
        got = f"{len(total)} values" if hasattr(total, "__len__") else type(total).__name__
        raise RewardError(f"batched {name} returned {got} for {len(prompts)} samples; expected a list of one "
                          "number per sample")
    values = [_finite(v, name, p, r) for v, p, r in zip(total, prompts, responses)]
    for part, part_values in components.items():
        if len(part_values) != len(prompts):
            raise RewardError(f"batched {name} returned {len(part_values)} values of component {part!r} for "
                              f"{len(prompts)} samples")
    return values, components


def _finite(value, name: str, prompt: str, response: str) -> float:
    """`value` as a float; a string, None, or a value float() refuses or that is NaN/infinite is the reward's bug,
    named with its sample (a NaN would silently turn the whole group's advantages into NaN)."""
    number = None
    if not isinstance(value, (str, bytes)) and value is not None:
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if number is None or not math.isfinite(number):
        raise RewardError(f"{name} returned {value!r} ({'not finite' if number is not None else 'not a number'}) "
                          f"on prompt {prompt!r}, response {response!r}")
    return number


def group_advantages(rewards: list[float], *, normalize: bool) -> list[float]:
    """reward - group mean, divided by the group's std when `normalize` (GRPO); a uniform group gives zeros."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    if normalize:
        return [(r - mean) / (std + 1e-6) for r in rewards]
    return [r - mean for r in rewards]


def score(groups: list[Rollout], *, reward_fn: Reward, decode, eos_id: int | None, normalize: bool) -> Scored:
    responses, prompts, answers = [], [], []
    for group in groups:
        for completion in group.completions:
            tokens = completion.token_ids
            # The EOS token stays in the trained sequence (the model must learn to stop) but not in the text.
            text_tokens = tokens[:tokens.index(eos_id)] if eos_id is not None and eos_id in tokens else tokens
            responses.append(decode(text_tokens))
            prompts.append(group.sample.prompt)
            answers.append(group.sample.answer)
    # One call for the whole step (a batched reward sees every sample at once), then split back into groups.
    rewards, components = apply_reward(reward_fn, prompts, responses, answers)
    sequences, start = [], 0
    for group in groups:
        group_rewards = rewards[start:start + len(group.completions)]
        start += len(group.completions)
        for completion, advantage in zip(group.completions, group_advantages(group_rewards, normalize=normalize)):
            sequences.append(TrainSequence(group.prompt_ids, completion.token_ids, completion.logprobs, advantage))
    return Scored(sequences, rewards, responses, components)
