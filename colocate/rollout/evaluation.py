"""Evaluation: pass@k of the current policy on a fixed prompt set, through the same engines as the rollouts.

    evaluator = make_evaluator(cfg, engines, tokenizer, reward_fn, task)   # None when eval.* turns it off
    if evaluator and should_evaluate(cfg.eval, num_done, cfg.algo.num_steps):
        record["eval"] = evaluator.run()   # {"pass_at_1", "pass_at_<k>", "reward_mean", ...}

The prompts are data.val_files (the first eval.max_prompts), or, for a run on a toy task (no data files), a fixed
set of the task's prompts drawn with eval.seed; the same prompts and the same sampling seed every time, so two
evaluations differ only by the policy. Each prompt gets eval.num_samples answers (greedy, eval.temperature=0: one)
from `EngineActor.generate`, prompts dealt round-robin over the engines, all engines at once. Answers are scored with
the job's reward (`scoring.apply_reward`, so a failing reward names its sample).

An answer is *correct* when its primary reward is >= 1 (within 1e-6): the first component of rollout.rewards when
the reward reports components (`RewardBreakdown`), else the whole reward. The built-ins give exactly 1 to a right
answer (math: verified equal; exact; char: every character right), so pass@k counts right answers, not partial
credit or format bonuses; `reward_mean` keeps the weighted total beside it.

pass@k is the unbiased estimator of Chen et al. 2021 (the Codex paper): with n samples of which c are correct,
1 - C(n-c, k) / C(n, k), the chance that k answers drawn without replacement from the n include a correct one,
averaged over prompts. pass@1 is then the fraction of correct answers.

A multi-turn job (rollout.env) is evaluated on whole episodes (`EpisodeEvaluator`, below), played with the
environment exactly as the rollouts play them: a rollout pool of its own (rollout/passes.py's `Passes`, fresh every
time) over the validation samples, eval.num_samples episodes each (greedy: one), up to eval.max_tokens (else
rollout.max_tokens) tokens and rollout.max_turns turns, with rollout.turn_stop and rollout.max_turn_tokens as in
training. Its environments live in the controller's process even when the rollouts' live in rollout.env_workers
(the two pools' episodes must not share keys in one worker). An episode's reward is its environment's, by
rollout.turn_reward; it is correct when its *last* turn's reward is >= 1 (an environment gives its verdict on the
last turn: the calculator's 1 for a right answer, copy_turns' 1 for an exact copy). An environment that fails
fails the evaluation whatever rollout.env_errors says: an evaluation that dropped episodes would not compare
with the next.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from colocate.config import EvalConfig, JobConfig
from colocate.errors import ConfigError
from colocate.rollout.passes import Passes, turn_stats
from colocate.rl.scoring import Reward, apply_reward, defined_mean, for_sources, reward_groups
from colocate.rl.tasks import PromptStream, Sample, Task

TOY_PROMPTS = 64  # toy-task evaluation prompts when eval.max_prompts is 0: a task has no "whole val set"
CORRECT = 1.0 - 1e-6  # a primary reward at least this is a right answer (float sums may miss 1.0 by an ulp)

Call = tuple[int, list[list[int]], dict]
"""One engine call: (engine index, prompt token ids, sampling dict of EngineActor.generate)."""
GenerateFn = Callable[[list[Call]], list[list[list[dict]]]]
"""Runs the calls (concurrently) and returns each one's result: per prompt, n completions {token_ids, ...}."""


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt: 1 - C(n-c, k) / C(n, k), as a product (the binomials overflow floats for
    large n): 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    n, c = num_samples, num_correct
    assert 0 <= c <= n and 1 <= k <= n, f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}"
    if n - c < k:  # every k-subset holds a correct answer
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def should_evaluate(cfg: EvalConfig, num_done: int, num_steps: int) -> bool:
    """Whether to evaluate when `num_done` of the run's `num_steps` steps are done (0: before the first step):
    at_start at 0, every eval.every_steps steps, and at_end after the last (once, if those coincide)."""
    if num_done == 0:
        return cfg.at_start
    if cfg.at_end and num_done == num_steps:
        return True
    return bool(cfg.every_steps) and num_done % cfg.every_steps == 0


def enabled(cfg: EvalConfig) -> bool:
    return bool(cfg.every_steps or cfg.at_start or cfg.at_end)


@dataclass(frozen=True)
class _Prompt:
    sample: Sample
    ids: list[int]
    max_tokens: int  # eval.max_tokens cut to what the context leaves after the prompt (the rollouts' guard)


class Evaluator:
    """Scores the policy the engines hold on a fixed list of samples; `run()` returns the metrics."""

    def __init__(self, cfg: JobConfig, engines: list, tokenizer, samples: list[Sample], reward_fn: Reward, *,
                 generate_fn: GenerateFn | None = None):
        """`generate_fn`: the transport to the engines (default: `EngineActor.generate` over Ray, every call
        in flight at once); tests pass a local one."""
        e = cfg.eval
        if e.max_prompts:
            samples = samples[:e.max_prompts]  # the first N: the same prompts every evaluation
        if not samples:
            raise ConfigError("eval: no validation prompts to evaluate (data.val_files holds none after "
                              "filtering); give data.val_files with prompts or turn evaluation off")
        assert engines, "an evaluator needs at least one engine"
        self.engines, self.tokenizer, self.reward_fn = engines, tokenizer, reward_fn
        self.generate_fn = generate_fn or self._ray_generate
        self.greedy = e.temperature == 0
        self.num_samples = 1 if self.greedy else e.num_samples
        max_tokens = e.max_tokens or cfg.rollout.max_tokens
        max_model_len = cfg.engine.max_model_len
        self.prompts = []
        for s in samples:
            ids = tokenizer(s.prompt, add_special_tokens=False).input_ids  # as the rollouts send it
            if len(ids) >= max_model_len:
                raise ConfigError(f"eval: prompt {s.prompt[:60]!r} is {len(ids)} tokens, leaving no room to answer "
                                  f"within engine.max_model_len={max_model_len}")
            self.prompts.append(_Prompt(s, ids, min(max_tokens, max_model_len - len(ids))))
        # greedy ignores top_p; sampled evaluation uses the rollouts' nucleus, so pass@k measures the policy trained
        self.sampling = {"n": self.num_samples, "temperature": e.temperature,
                         "top_p": 1.0 if self.greedy else cfg.rollout.top_p, "seed": e.seed}

    def _ray_generate(self, calls: list[Call]) -> list[list[list[dict]]]:
        import ray

        return ray.get([self.engines[engine].generate.remote(ids, sampling) for engine, ids, sampling in calls])

    def calls(self) -> tuple[list[Call], list[list[int]]]:
        """The engine calls, and for each the indices of its prompts: prompt i goes to engine i % num_engines,
        one call per engine and token budget (a budget is a call's sampling)."""
        grouped: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(self.prompts):
            grouped.setdefault((i % len(self.engines), p.max_tokens), []).append(i)
        calls, indices = [], []
        for (engine, budget), members in grouped.items():
            calls.append((engine, [self.prompts[i].ids for i in members], {**self.sampling, "max_tokens": budget}))
            indices.append(members)
        return calls, indices

    def run(self) -> dict:
        """Generate, score and summarise; the engines must be awake with the weights to evaluate."""
        started = time.perf_counter()
        calls, indices = self.calls()
        results = self.generate_fn(calls)
        assert len(results) == len(calls), f"{len(results)} results for {len(calls)} engine calls"
        completions: list[list[dict]] = [[] for _ in self.prompts]
        for members, result in zip(indices, results):
            assert len(result) == len(members), f"an engine returned {len(result)} prompts' answers for {len(members)}"
            for i, answers in zip(members, result):
                assert len(answers) == self.num_samples, f"{len(answers)} answers, asked for {self.num_samples}"
                completions[i] = answers
        return {**self.summarise(completions), "seconds": time.perf_counter() - started}

    def summarise(self, completions: list[list[dict]]) -> dict:
        """The metrics of every prompt's answers (in prompt order)."""
        eos = self.tokenizer.eos_token_id
        prompts, responses, answers, lengths, sources, truncated = [], [], [], [], [], 0
        for p, group in zip(self.prompts, completions):
            for c in group:
                tokens = c["token_ids"]
                # as scoring.score: the EOS and anything after it are not part of the text the reward reads
                text_tokens = tokens[:tokens.index(eos)] if eos is not None and eos in tokens else tokens
                responses.append(self.tokenizer.decode(text_tokens))
                prompts.append(p.sample.prompt)
                answers.append(p.sample.answer)
                sources.append(p.sample.source)
                lengths.append(len(tokens))
                truncated += c.get("finish_reason") == "length"
        rewards, components = apply_reward(for_sources(self.reward_fn, sources), prompts, responses, answers,
                                           name="reward (evaluation)")
        if getattr(self.reward_fn, "by_source", False):  # each answer judged by its own source's first reward
            primary = [components[self.reward_fn.primary(s)][i] for i, s in enumerate(sources)]
        else:
            primary = next(iter(components.values())) if components else rewards
        n = self.num_samples
        # every answer, for the run's eval/ folder (what a user reads to see *how* the policy answers)
        self.last_answers = [
            {"prompt": p.sample.prompt, "answer": p.sample.answer,
             "responses": responses[j * n:(j + 1) * n], "token_ids": [c["token_ids"] for c in group],
             "rewards": rewards[j * n:(j + 1) * n]}
            for j, (p, group) in enumerate(zip(self.prompts, completions))]
        correct = [sum(v >= CORRECT for v in primary[j * n:(j + 1) * n]) for j in range(len(self.prompts))]
        out = _pass_rates(n, correct)
        per_source = {}
        if {p.sample.source for p in self.prompts} != {""}:  # verl reports AIME and MATH500 apart: so does this
            for name in sorted({p.sample.source for p in self.prompts}):
                mine = [j for j, p in enumerate(self.prompts) if p.sample.source == name]
                per_source[name or "(none)"] = {
                    **_pass_rates(n, [correct[j] for j in mine]), "num_prompts": len(mine),
                    "reward_mean": statistics.fmean(r for j in mine for r in rewards[j * n:(j + 1) * n])}
        return {
            **out,
            **({"sources": per_source} if per_source else {}),
            "reward_mean": statistics.fmean(rewards),
            **{f"reward_{name}_mean": defined_mean(values) for name, values in components.items()},
            "num_prompts": len(self.prompts),
            "num_samples": n,
            "response_len_mean": statistics.fmean(lengths),
            "truncated_fraction": truncated / len(lengths),  # answers cut at the token budget
        }


def _pass_rates(n: int, correct: list[int]) -> dict[str, float]:
    """pass@1, and pass@n with more than one sample a prompt, over prompts with `correct` right answers of n."""
    out = {"pass_at_1": statistics.fmean(pass_at_k(n, c, 1) for c in correct)}
    if n > 1:
        out[f"pass_at_{n}"] = statistics.fmean(pass_at_k(n, c, n) for c in correct)
    return out


class _Samples:
    """The validation samples as the prompt stream a pool draws from: each once, in order."""

    def __init__(self, samples: list[Sample]):
        self.samples, self.position = samples, 0

    def next_batch(self, n: int) -> list[Sample]:
        batch = self.samples[self.position:self.position + n]
        self.position += len(batch)
        return batch


class EpisodeEvaluator:
    """Scores the policy the engines hold on whole episodes of rollout.env (the module docstring)."""

    def __init__(self, cfg: JobConfig, engines: list, tokenizer, samples: list[Sample]):
        e = cfg.eval
        self.samples = samples[:e.max_prompts] if e.max_prompts else samples
        self.num_samples = 1 if e.temperature == 0 else e.num_samples
        rollout = dataclasses.replace(
            cfg.rollout, num_prompts=len(self.samples), num_samples=self.num_samples,
            max_tokens=e.max_tokens or cfg.rollout.max_tokens, temperature=e.temperature,
            top_p=1.0 if e.temperature == 0 else cfg.rollout.top_p, partial_tokens=0, oversample=1.0,
            leftover="drop", env_workers=0, env_errors="fail")
        self.cfg = dataclasses.replace(cfg, rollout=rollout, engine=dataclasses.replace(cfg.engine, seed=e.seed))
        self.engines, self.tokenizer = engines, tokenizer
        self.last_answers: list[dict] = []

    def run(self) -> dict:
        """Play every episode to its end with the policy the engines hold (awake), then score them."""
        started = time.perf_counter()
        rollouts = Passes(self.cfg, self.engines, self.tokenizer, _Samples(self.samples))
        groups, _ = rollouts.collect(version=0)  # one policy: no answer outlives a version
        assert len(groups) == len(self.samples), f"{len(groups)} evaluated groups for {len(self.samples)} samples"
        scored = reward_groups(groups, reward_fn=None, decode=self.tokenizer.decode,
                               eos_id=self.tokenizer.eos_token_id, turn_reward=self.cfg.rollout.turn_reward)
        n = self.num_samples
        episodes = [a for g in groups for a in g.completions]
        correct = [sum(bool(a.turn_rewards) and a.turn_rewards[-1] >= CORRECT for a in g.completions)
                   for g in groups]
        self.last_answers = [
            {"prompt": g.group.sample.prompt, "answer": g.group.sample.answer, "responses": g.responses,
             "token_ids": [a.token_ids for a in g.group.completions], "rewards": g.rewards,
             "turn_rewards": [a.turn_rewards for a in g.group.completions]}
            for g in scored]
        out = {"pass_at_1": statistics.fmean(pass_at_k(n, c, 1) for c in correct)}
        if n > 1:
            out[f"pass_at_{n}"] = statistics.fmean(pass_at_k(n, c, n) for c in correct)
        stats = turn_stats(episodes, num_env_dropped=0)
        return {
            **out,
            "reward_mean": statistics.fmean(r for g in scored for r in g.rewards),
            "num_prompts": len(groups),
            "num_samples": n,
            "response_len_mean": statistics.fmean(len(a.token_ids) for a in episodes),
            "truncated_fraction": sum(a.finish_reason == "length" for a in episodes) / len(episodes),
            "turns_per_episode": stats["turns_per_episode"],
            "num_observation_tokens": stats["num_observation_tokens"],
            "seconds": time.perf_counter() - started,
        }


def eval_samples(cfg: JobConfig, tokenizer, task: Task | None) -> list[Sample]:
    """data.val_files' samples, or with no data files a fixed draw of the toy task's prompts (eval.seed)."""
    if cfg.data.val_files:
        from colocate.rl.data import load_val_samples

        return load_val_samples(cfg, tokenizer)
    # JobConfig.check refuses evaluation of a run on data.train_files without val files
    assert not cfg.data.train_files, "evaluation of data.train_files needs data.val_files"
    assert task is not None, "toy-task evaluation needs the task"
    return PromptStream(task, seed=cfg.eval.seed).next_batch(cfg.eval.max_prompts or TOY_PROMPTS)


def make_evaluator(cfg: JobConfig, engines: list, tokenizer, reward_fn: Reward, task: Task | None, *,
                   generate_fn: GenerateFn | None = None) -> Evaluator | EpisodeEvaluator | None:
    """The job's evaluator, or None when eval.every_steps, eval.at_start and eval.at_end are all off. Reads the
    validation files: call it before the first step so a bad file stops the job early."""
    if not enabled(cfg.eval):
        return None
    if cfg.rollout.env:
        return EpisodeEvaluator(cfg, engines, tokenizer, eval_samples(cfg, tokenizer, task))
    return Evaluator(cfg, engines, tokenizer, eval_samples(cfg, tokenizer, task), reward_fn, generate_fn=generate_fn)
