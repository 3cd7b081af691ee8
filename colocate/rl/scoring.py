"""Score rollouts: each answer's reward (user code, checked), DAPO's overlong punishment, then the advantages
(rl/advantages.py) of the groups a step trains.

    groups = [Group(sample, prompt_ids, answers), ...]          # rl/samples.py, from the rollout pool
    scored_groups = reward_groups(groups, reward_fn=task.reward, decode=tokenizer.decode, eos_id=2)
    keep_informative(scored_groups, num_groups=16)                # algo.dynamic_sampling: the rest not trained
    scored = Scored.from_groups(scored_groups, algo=cfg.algo)     # advantages; truncated answers left out if asked
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

from colocate.config import AlgoConfig
from colocate.errors import RewardError
from colocate.rl.advantages import estimate_advantages
from colocate.rl.samples import Answer, Group
from colocate.rl.samples import Sequence as TrainSequence


@dataclass
class RewardBreakdown:
    """What a batched reward may return: each sample's total and, per named component, each sample's value."""

    total: list[float]
    components: dict[str, list[float]] = field(default_factory=dict)


Reward = Callable  # per-sample (prompt, response, answer) -> float, or batched (see the module docstring)


@dataclass
class ScoredGroup:
    """One prompt's answers with their rewards: the unit dynamic sampling keeps or drops."""

    group: Group
    rewards: list[float]
    """Each answer's reward as trained: the reward function's, plus the overlong punishment when it is on."""
    responses: list[str]
    components: dict[str, list[float]] = field(default_factory=dict)
    trained: bool = True
    """False: scored and reported, not trained (dynamic sampling: a uniform group, or one beyond those wanted)."""
    task_rewards: list[float] | None = None
    """The reward function's values before the overlong punishment, when it is on (None: `rewards`)."""

    @property
    def informative(self) -> bool:
        """The reward function's values differ (DAPO eq. 11 keeps groups with 0 < correct < all): a group of
        equally good answers that only the overlong punishment tells apart is not, as in DAPO."""
        rewards = self.rewards if self.task_rewards is None else self.task_rewards
        return max(rewards) > min(rewards)


def keep_informative(groups: list[ScoredGroup], num_groups: int) -> tuple[int, int]:
    """DAPO's dynamic sampling: train the first `num_groups` informative groups, and none of the others (they are
    still reported: the step's rewards are the policy's, not those of the groups kept). Returns the number of
    uniform groups and of informative ones beyond those wanted."""
    num_kept = num_uniform = num_surplus = 0
    for g in groups:
        g.trained = g.informative and num_kept < num_groups
        num_kept += g.trained
        num_uniform += not g.informative
        num_surplus += g.informative and not g.trained
    return num_uniform, num_surplus


@dataclass
class Scored:
    sequences: list[TrainSequence]
    rewards: list[float]
    responses: list[str] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)  # per named reward, when it has parts
    response_lengths: list[int] = field(default_factory=list)
    """Every answer's tokens, trained or not."""
    num_truncated: int = 0
    """Answers cut off at their token budget (finish reason length)."""
    num_masked: int = 0
    """Of them, those left out of the loss (algo.mask_truncated)."""
    groups: list[ScoredGroup] = field(default_factory=list)
    """The groups given, trained or not."""
    origins: list[tuple[int, int]] = field(default_factory=list)
    """Per sequence: its group's index in `groups` and its answer's in the group (logging.rollouts)."""

    @classmethod
    def from_groups(cls, groups: list[ScoredGroup], *, algo: AlgoConfig) -> Scored:
        """The step's training sequences: each answer of the groups to train (ScoredGroup.trained) with its
        advantage (algo.advantage), less the truncated answers when algo.mask_truncated (they still count in
        their group's baseline, as in DAPO's overlong filter). The rewards are those of every group given."""
        trained = [g for g in groups if g.trained]

        def masked(answer: Answer) -> bool:
            return algo.mask_truncated and answer.finish_reason == "length"

        # REINFORCE++'s batch statistics count the tokens trained: a masked answer weighs 0 there, as in the
        # trainer's KL-shaped returns (a group baseline still counts it: DAPO's overlong filter)
        advantages = estimate_advantages(
            [g.rewards for g in trained], estimator=algo.advantage, kl_in_reward=algo.kl_in_reward,
            num_tokens=[[0 if masked(a) else sum(a.mask) if a.mask else len(a.token_ids)  # observations untrained
                         for a in g.group.completions] for g in trained])
        sequences, origins, num_masked = [], [], 0
        places = [i for i, g in enumerate(groups) if g.trained]
        for place, group, group_advantages in zip(places, trained, advantages):
            for index, (answer, advantage) in enumerate(zip(group.group.completions, group_advantages)):
                if masked(answer):
                    num_masked += 1
                    continue
                sequences.append(TrainSequence(group.group.prompt_ids, answer.token_ids, answer.logprobs, advantage,
                                               mask=answer.mask or None, routing=answer.routing))
                origins.append((place, index))
        names = {name for g in groups for name in g.components}
        return cls(sequences, [r for g in groups for r in g.rewards], [t for g in groups for t in g.responses],
                   {name: [v for g in groups for v in g.components[name]] for name in names},
                   response_lengths=[len(a.token_ids) for g in groups for a in g.group.completions],
                   num_truncated=sum(a.finish_reason == "length" for g in groups for a in g.group.completions),
                   num_masked=num_masked, groups=list(groups), origins=origins)

    def stats(self) -> dict:
        num_tokens = self.response_lengths
        return {
            "reward_mean": statistics.fmean(self.rewards),
            "reward_std": statistics.pstdev(self.rewards),
            "reward_min": min(self.rewards),
            "reward_max": max(self.rewards),
            **{f"reward_{name}_mean": defined_mean(values) for name, values in self.components.items()},
            "response_len_mean": statistics.fmean(num_tokens),
            "response_lengths": list(num_tokens),  # every answer's: `colocate simulate --lengths metrics:PATH`
            "num_response_tokens": sum(num_tokens),
            "num_trained_sequences": len(self.sequences),
            "num_trained_tokens": sum(s.num_trained_tokens for s in self.sequences),
            "truncated_fraction": self.num_truncated / len(self.rewards),
            "num_masked_truncated": self.num_masked,
            **({"sources": sources} if (sources := by_source(self.groups)) else {}),
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


def overlong_punishment(num_tokens: int, *, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_tokens - buffer tokens, then falling
    linearly to -penalty at max_tokens. `max_tokens`: the answer's own budget (rollout.max_tokens, or less where
    the context left less after a long prompt), where it is cut off."""
    excess = num_tokens - max(0, max_tokens - buffer)
    return -penalty * min(excess, buffer) / buffer if buffer and excess > 0 else 0.0


def response_text_tokens(answer: Answer, eos_id: int | None) -> list[int]:
    """The tokens of an answer's text. The EOS token stays in the trained sequence (the model must learn to stop)
    but not in the text: a single-turn answer ends at its first; a multi-turn episode keeps every turn and
    observation, less the EOS that ended each of the model's turns (an observation's own tokens stay as given)."""
    tokens = answer.token_ids
    if eos_id is None or eos_id not in tokens:
        return tokens
    if not answer.turn_starts:
        return tokens[:tokens.index(eos_id)]
    return [t for t, sampled in zip(tokens, answer.mask) if not (sampled and t == eos_id)]


def reward_groups(groups: list[Group], *, reward_fn: Reward, decode, eos_id: int | None,
                  algo: AlgoConfig | None = None, turn_reward: str | None = None) -> list[ScoredGroup]:
    """Every answer's reward, one call for the whole step (a batched reward sees every sample at once), split back
    into groups; with algo.overlong_buffer, DAPO's overlong punishment (against each answer's budget) added.
    `turn_reward` (multi-turn, rollout.turn_reward): each episode's reward is its environment's, the sum or the
    last of its turns' rewards, and `reward_fn` is not called."""
    responses, prompts, answers, lengths, budgets, sources = [], [], [], [], [], []
    for group in groups:
        for completion in group.completions:
            responses.append(decode(response_text_tokens(completion, eos_id)))
            tokens = completion.token_ids
            prompts.append(group.sample.prompt)
            answers.append(group.sample.answer)
            sources.append(group.sample.source)
            lengths.append(len(tokens))
            budgets.append(completion.max_tokens)
    if turn_reward is None:
        rewards, components = apply_reward(for_sources(reward_fn, sources), prompts, responses, answers)
    else:
        turns = [c.turn_rewards for g in groups for c in g.completions]
        rewards = [sum(t) if turn_reward == "sum" else (t[-1] if t else 0.0) for t in turns]
        components = {}
    task_rewards = None
    if algo is not None and algo.overlong_buffer:
        shaping = [overlong_punishment(n, max_tokens=budget, buffer=algo.overlong_buffer,
                                       penalty=algo.overlong_penalty) for n, budget in zip(lengths, budgets)]
        task_rewards, rewards = rewards, [r + p for r, p in zip(rewards, shaping)]
        components = {**components, "overlong": shaping}
    out, start = [], 0
    for group in groups:
        end = start + len(group.completions)
        out.append(ScoredGroup(group, rewards[start:end], responses[start:end],
                               {name: values[start:end] for name, values in components.items()},
                               task_rewards=None if task_rewards is None else task_rewards[start:end]))
        start = end
    return out


def for_sources(reward_fn: Reward, sources: Sequence[str]) -> Reward:
    """`reward_fn` for samples of these sources: a per-source reward (rollout.source_rewards) bound to them, any
    other as it is."""
    return reward_fn.for_sources(sources) if getattr(reward_fn, "by_source", False) else reward_fn


def defined_mean(values: Sequence[float]) -> float:
    """The mean of the values that are not NaN (a per-source reward's component, NaN on the answers of the
    sources it does not score); NaN when none is."""
    defined = [v for v in values if not math.isnan(v)]
    return statistics.fmean(defined) if defined else math.nan


def by_source(groups: list[ScoredGroup]) -> dict[str, dict]:
    """Per data source (Sample.source), when the step's groups have a named one: the answers' reward mean, their
    count and their mean length."""
    names = {g.group.sample.source for g in groups}
    if names == {""}:
        return {}
    out = {}
    for name in sorted(names):
        mine = [g for g in groups if g.group.sample.source == name]
        rewards = [r for g in mine for r in g.rewards]
        out[name or "(none)"] = {"reward_mean": statistics.fmean(rewards), "num_answers": len(rewards),
                                 "response_len_mean": statistics.fmean(len(a.token_ids) for g in mine
                                                                       for a in g.group.completions)}
    return out


def score(groups: list[Group], *, reward_fn: Reward, decode, eos_id: int | None,
          algo: AlgoConfig | None = None) -> Scored:
    """reward_groups, then the advantages of every group (no dynamic sampling): the step's Scored."""
    algo = algo or AlgoConfig()
    return Scored.from_groups(reward_groups(groups, reward_fn=reward_fn, decode=decode, eos_id=eos_id, algo=algo),
                              algo=algo)
