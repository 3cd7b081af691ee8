"""The records a step's data travels in, from the engine's tokens to the loss: typed, never dicts of strings.

    Answer     one sampled answer as the rollout pool builds it: tokens, the behaviour logprob of each, the
               policy version that sampled each, why it ended, its seed and budget
    Group    a complete group: one prompt (its Sample and token ids) and its answers, ready to score
    Sequence   what a trainer rank trains on: prompt and response tokens, the behaviour logprobs, the advantage

The controller hands Sequences to the trainer actors as they are (Ray pickles dataclasses); adding a per-sample
field means adding it here and where it is set, not editing every dict along the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colocate.rl.tasks import Sample


@dataclass
class Answer:
    seed: int
    max_tokens: int
    """The whole answer's budget, fixed at creation (never renewed by a continuation)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """The engine's logprob of each token when it was sampled (after temperature and top-p)."""
    versions: list[int] = field(default_factory=list)
    """Policy version that sampled each token."""
    finish_reason: str | None = None
    num_prefill_computed: int = 0
    num_prefill_cached: int = 0
    mask: list[int] = field(default_factory=list)
    """Multi-turn (rollout.env): 1 for each token the engine sampled, 0 for each observation token the
    environment gave (no loss, no behaviour logprob); empty for a single-turn answer (every token sampled)."""
    turn_rewards: list[float] = field(default_factory=list)
    """Multi-turn: each finished turn's reward, as the environment gave it."""
    turn_starts: list[int] = field(default_factory=list)
    """Multi-turn: where each turn of the model starts in `token_ids` (after the observation before it; an empty
    observation leaves no token between two turns, so the mask alone cannot tell them apart)."""
    routing: Any = None
    """algo.router_replay: the engine's routing of the prompt and the answer, uint16 [positions, layers, top_k]
    (rl/routing.py); None without it."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def restart(self) -> None:
        self.token_ids, self.logprobs, self.versions, self.mask = [], [], [], []
        self.turn_rewards, self.turn_starts = [], []
        self.finish_reason, self.routing = None, None

    def actions(self) -> list[list[int]]:
        """Multi-turn: the tokens the model sampled in each of its turns, in order (the last may be going on)."""
        ends = self.turn_starts[1:] + [len(self.token_ids)]
        return [[t for t, sampled in zip(self.token_ids[start:end], self.mask[start:end]) if sampled]
                for start, end in zip(self.turn_starts, ends)]

    def num_turn_tokens(self) -> int:
        """Multi-turn: the tokens the model has sampled in its current turn."""
        return sum(self.mask[self.turn_starts[-1]:]) if self.turn_starts else 0


@dataclass
class Group:
    sample: Sample
    prompt_ids: list[int]
    completions: list[Answer]


@dataclass
class Sequence:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # the engine's logprob of each response token when it was sampled
    advantage: float
    mask: list[int] | None = None
    """Multi-turn: 1 for each response token to train, 0 for an environment's observation token; None: all 1."""
    routing: Any = None
    """algo.router_replay: the experts the engine routed each position to (Answer.routing); None: route freely."""
    old_logprobs: list[float] | None = None
    """algo.old_logprobs=recompute|decoupled: the trainer's logprob of each response token before the step's first
    update (the proximal policy); None: the ratio's old policy is the engine's (`logprobs`)."""
    token_advantages: list[float] | None = None
    """algo.advantage=gae: each response token's advantage (rl/gae.py, whitened; 0 on observations); None: every
    token takes `advantage`."""
    returns: list[float] | None = None
    """algo.advantage=gae: each response token's return, the critic's regression target."""
    old_values: list[float] | None = None
    """algo.advantage=gae: the critic's value of each response token before the step's first update (value
    clipping's anchor)."""

    @property
    def num_trained_tokens(self) -> int:
        return len(self.response_ids) if self.mask is None else sum(self.mask)
