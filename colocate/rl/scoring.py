"""Score rollouts and turn rewards into group-relative (GRPO) advantages.

    groups = [Rollout(sample, prompt_ids, completions), ...]      # completions from EngineActor.generate
    scored = score(groups, reward_fn=task.reward, decode=tokenizer.decode, eos_id=2, normalize=True)
    scored.sequences   # dicts for trainer.grpo.Sequence: prompt_ids, response_ids, logprobs, advantage

A reward function is user code: when it raises, `RewardError` names the prompt and response that broke it, so
the controller can report the step and stop cleanly instead of losing the run to a bare traceback.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from colocate.rl.tasks import RewardFn, Sample


class RewardError(RuntimeError):
    """The reward function raised on a (prompt, response)."""


@dataclass
class Rollout:
    sample: Sample
    prompt_ids: list[int]
    completions: list[dict]  # token_ids, logprobs, finish_reason


@dataclass
class Scored:
    sequences: list[dict]
    rewards: list[float]
    responses: list[str] = field(default_factory=list)

    def stats(self) -> dict:
        num_tokens = [len(s["response_ids"]) for s in self.sequences]
        return {
            "reward_mean": statistics.fmean(self.rewards),
            "reward_std": statistics.pstdev(self.rewards),
            "reward_min": min(self.rewards),
            "reward_max": max(self.rewards),
            "response_len_mean": statistics.fmean(num_tokens),
            "num_response_tokens": sum(num_tokens),
        }


def group_advantages(rewards: list[float], *, normalize: bool) -> list[float]:
    """reward - group mean, divided by the group's std when `normalize` (GRPO); a uniform group gives zeros."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    if normalize:
        return [(r - mean) / (std + 1e-6) for r in rewards]
    return [r - mean for r in rewards]


def score(groups: list[Rollout], *, reward_fn: RewardFn, decode, eos_id: int | None, normalize: bool) -> Scored:
    sequences, rewards, responses = [], [], []
    for group in groups:
        group_rewards = []
        for completion in group.completions:
            tokens = completion["token_ids"]
            # The EOS token stays in the trained sequence (the model must learn to stop) but not in the text.
            text_tokens = tokens[:tokens.index(eos_id)] if eos_id is not None and eos_id in tokens else tokens
            response = decode(text_tokens)
            try:
                reward = float(reward_fn(group.sample.prompt, response, group.sample.answer))
            except Exception as e:
                raise RewardError(f"reward function raised {type(e).__name__}: {e} on prompt "
                                  f"{group.sample.prompt!r}, response {response!r}") from e
            group_rewards.append(reward)
            responses.append(response)
        for completion, advantage in zip(group.completions, group_advantages(group_rewards, normalize=normalize)):
            sequences.append({
                "prompt_ids": group.prompt_ids,
                "response_ids": completion["token_ids"],
                "logprobs": completion["logprobs"],
                "advantage": advantage,
            })
        rewards.extend(group_rewards)
    return Scored(sequences, rewards, responses)
