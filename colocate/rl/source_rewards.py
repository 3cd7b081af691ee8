"""Per-source rewards (rollout.source_rewards): each data row's source (its data.source_key column, verl's
`data_source`) picks the rewards that score its answers, so one job can train on math and on code, each scored
its own way, and report each apart.

    rollout.source_rewards='{"gsm8k": "math:1.0,format:0.1", "aime": "math", "*": "exact"}'

    reward = SourceRewards.from_config(cfg)                      # rl/rewards.py make_reward builds it
    values, parts = apply_reward(reward.for_sources(sources), prompts, responses, answers)

Each value is a rollout.rewards spec (built-ins and module:function plug-ins, weighted); "*" scores every source
not listed. A source with no entry and no "*" is refused, naming it, when the data is read (before any actor).
A component's values are NaN on the answers of sources it does not score: the metrics average each over the
answers it scored (rl/scoring.py `defined_mean`). A reward model (model:PATH, judge:PATH) serves rollout.rewards only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from colocate.config import ConfigError, JobConfig
from colocate.rl.rewards import CombinedReward, parse_rewards
from colocate.rl.scoring import RewardBreakdown, apply_reward

KEY = "rollout.source_rewards"
ANY = "*"


def parse_source_rewards(text: str) -> dict[str, CombinedReward]:
    """The JSON object of rollout.source_rewards as each source's reward; one line naming the key otherwise."""
    try:
        specs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{KEY}={text!r} is invalid: not a JSON object ({e.msg}); e.g. "
                          '{"gsm8k": "math", "*": "exact"}') from None
    if not isinstance(specs, dict) or not specs or not all(isinstance(v, str) for v in specs.values()):
        raise ConfigError(f"{KEY}={text!r} is invalid: expected a JSON object of source -> rollout.rewards spec, "
                          'e.g. {"gsm8k": "math", "*": "exact"}')
    out = {}
    for source, spec in specs.items():
        components = parse_rewards(spec, key=f"{KEY}[{source!r}]")
        if any(c.fn is None for c in components):
            raise ConfigError(f"{KEY}[{source!r}]={spec!r} is invalid: a reward model serves rollout.rewards only; "
                              "valid here: built-ins and module:function rewards")
        out[source] = CombinedReward(components)
    return out


def check_covered(sources: Sequence[str], rewards: dict, *, key: str) -> None:
    """Every source of the rows read for `key` (data.train_files, data.val_files) has its reward, or "*" does."""
    if ANY in rewards:
        return
    missing = sorted({s for s in sources if s not in rewards})
    if missing:
        raise ConfigError(f"{KEY} is invalid for {key}: its rows' source {missing[0]!r} has no reward (sources "
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
