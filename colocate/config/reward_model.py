"""The `reward_model` section: how the job's reward model is served, when rollout.rewards names one.

    rollout.rewards=model:PATH          a sequence classifier: each answer's reward is its score (one logit)
    rollout.rewards=judge:PATH          a generative judge: each answer's reward is the number its verdict gives
    rollout.rewards=math:1,model:PATH:0.5   beside rule rewards, weighted like any component

The model runs as a vLLM engine of its own (rollout/reward_model.py, engine/reward_engine.py) on the first device
slots of the policy's engines, and sleeps with them while the trainer trains. The checks of one key sit here;
which path is a reward model, and whether it exists, is job/checks.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from colocate.config.fields import bad, positive

DEFAULT_JUDGE_PROMPT = ("question: {prompt}\nanswer: {response}\nreference: {answer}\n"
                        "score the answer from 0 to 1. score: ")


@dataclass
class RewardModelConfig:
    tp: int = 1
    """Tensor-parallel size of the reward model's engine; it runs on the first tp slots of the policy's engines, sharing
    their devices."""
    max_model_len: int = 0
    """Longest input the reward model reads (prompt + answer, or the judge's prompt); longer inputs lose their beginning
    and are counted. 0: engine.max_model_len."""
    kv_cache_gib: float = 0.0625
    """CPU: the reward model's KV cache per worker in GiB."""
    gpu_memory_utilization: float = 0.1
    """CUDA: fraction of GPU memory the reward model's engine may use (beside engine.gpu_memory_utilization)."""
    judge_prompt: str = DEFAULT_JUDGE_PROMPT
    """judge:PATH: the judge's prompt, with {prompt}, {response} and {answer} filled in (and the judge's chat template
    around it, when its tokenizer has one)."""
    judge_max_tokens: int = 16
    """judge:PATH: the longest verdict the judge writes (greedy)."""
    verdict_pattern: str = r"-?\d+(?:\.\d+)?"
    """judge:PATH: regular expression of the score in a verdict; its first match (its first group, if it has one) is
    read as a number."""
    unparsed_reward: float = 0.0
    """judge:PATH: the reward of an answer whose verdict has no score (counted in the metrics)."""

    def check(self) -> None:
        positive(self, "reward_model", "tp", "judge_max_tokens")
        if self.max_model_len < 0:
            raise bad("reward_model.max_model_len", self.max_model_len, "must be >= 0 (0: engine.max_model_len)")
        if self.kv_cache_gib <= 0:
            raise bad("reward_model.kv_cache_gib", self.kv_cache_gib, "must be > 0")
        if not 0 < self.gpu_memory_utilization < 1:
            raise bad("reward_model.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1)")
        try:
            re.compile(self.verdict_pattern)
        except re.error as e:
            raise bad("reward_model.verdict_pattern", self.verdict_pattern, f"not a regular expression ({e})") \
                from None
        try:
            self.judge_prompt.format(prompt="", response="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise bad("reward_model.judge_prompt", self.judge_prompt, f"cannot be filled ({type(e).__name__}: "
                      f"{e}); valid fields: {{prompt}}, {{response}}, {{answer}} (double a literal brace)") from None


REWARD_MODEL_KINDS = {"model": "a sequence classifier", "judge": "a generative judge"}


@dataclass(frozen=True)
class RewardModelSpec:
    """The reward model a rollout.rewards component names: `model:PATH[:weight]` or `judge:PATH[:weight]`."""

    kind: str  # "model" or "judge": also the component's name in the metrics (reward_model_mean)
    path: str  # a model directory, a hub id, or an embedded reward preset (tiny-rm)
    weight: float = 1.0


def reward_model_spec(item: str) -> RewardModelSpec | None:
    """The reward model of one rollout.rewards component, or None when it names none. A trailing ":<number>"
    is the weight. Reads the text only (no file, no import): the section's checks and rl/rewards.py both use it."""
    kind, colon, rest = item.strip().partition(":")
    if kind not in REWARD_MODEL_KINDS or not colon:
        return None
    path, colon, tail = rest.rpartition(":")
    try:
        weight = float(tail) if colon else None
    except ValueError:
        weight = None
    if weight is None:
        path, weight = rest, 1.0
    return RewardModelSpec(kind, path.strip(), weight)


def reward_models_in(rewards: str) -> list[RewardModelSpec]:
    return [spec for item in rewards.split(",") if (spec := reward_model_spec(item)) is not None]
