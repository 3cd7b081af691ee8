"""The `algo` section: the RL objective, from the advantage estimator to how a step's token losses are summed.

Each key names the paper its choice comes from; docs/algorithms.md gives the formulas and configs/algos/ the
presets (grpo, dapo, dr_grpo, gspo, cispo, rloo, reinforce_pp) that set a paper's keys together. The checks of
one key sit here; those that read another section (rollout.num_samples, rollout.temperature) are
JobConfig.check's (config/schema.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.config.fields import bad, non_negative, one_of, positive

ADVANTAGES = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"]
GROUP_ADVANTAGES = {"grpo", "dr_grpo", "rloo"}  # a baseline from the prompt's own group: need >= 2 samples
LOSS_AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
POLICY_LOSSES = ["ppo", "gspo", "cispo"]
GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS (vllm/v1/sample/sampler.py): below it a request is sampled greedily


OLD_LOGPROBS = ["engine", "recompute", "decoupled"]
MODES = ["sync", "one_step_off", "async"]
OVERLAPPED_MODES = {"one_step_off", "async"}  # the engines generate while the trainer trains: both stay resident


@dataclass
class AlgoConfig:
    num_steps: int = 150
    """RL steps to run."""
    mode: str = "sync"
    """sync: each step rolls out with the weights it trains (after the previous step's sync). one_step_off: the rollout
    of step k+1 runs while step k trains, with the weights after step k-1, so every token trained is one policy version
    old (corrected by the ratio to its behaviour logprobs, and by TIS/MIS when set); the engine and the trainer stay
    resident together, and the preflight refuses a job whose memory does not allow it. async: the engines generate
    without pause in a thread, pass after pass of rollout.partial_tokens tokens per answer; each step trains the first
    rollout.num_prompts complete groups, and its weight update waits only for the pass in flight to end (pause, sync,
    resume), so unfinished answers go on under the new weights, every token tagged with its version and none older than
    rollout.max_lag when trained (docs/async.md)."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (reward minus its group's mean, over the group's std: Shao et al. 2024, DeepSeekMath),
    dr_grpo (minus the group's mean only: Liu et al. 2025, Dr. GRPO), rloo (minus the mean of the group's other samples:
    Ahmadian et al. 2024), reinforce_pp (REINFORCE++, Hu 2025: normalised over the whole batch's response tokens, no
    group needed; with algo.kl_in_reward the KL is folded into each token's return first), gae (PPO's generalised
    advantage estimation against a learned value model, Schulman et al. 2016: needs critic.model_path; algo.gamma and
    algo.lam set it, and the advantages are whitened over the step's tokens)."""
    gamma: float = 1.0
    """gae: the discount per token (1: none, as verl's and OpenRLHF's LLM recipes use)."""
    lam: float = 0.95
    """gae: lambda, the bias/variance trade of the advantage (1: the Monte-Carlo return minus the value; 0: the one-step
    TD error)."""
    policy_loss: str = "ppo"
    """ppo (the clipped token ratio, Schulman et al. 2017; with algo.clip_ratio_c the dual clip of Ye et al. 2020), gspo
    (one ratio per sequence, the length-normalised geometric mean of its token ratios, clipped: Zheng et al. 2025,
    GSPO), cispo (the clipped ratio as a stop-gradient weight on the log-prob, so no token loses its gradient: MiniMax
    2025, MiniMax-M1)."""
    loss_aggregation: str = "token_mean"
    """How a step's token losses become one number: token_mean (over every response token of the step: DAPO, Yu et al.
    2025), seq_mean_token_mean (each sequence's token mean, then the mean over sequences: the GRPO paper),
    seq_mean_token_sum_norm (the token sum over sequences x rollout.max_tokens, a constant: Dr. GRPO, no length
    bias)."""
    clip_eps: float = 0.2
    """The ratio's clip: [1 - clip_eps, 1 + clip_eps] unless clip_eps_low / clip_eps_high set either side."""
    clip_eps_low: float | None = None
    """Lower side of the clip, [1 - clip_eps_low, ...]; null: algo.clip_eps. cispo: 1.0 leaves the weight unbounded
    below (MiniMax-M1)."""
    clip_eps_high: float | None = None
    """Upper side of the clip, [..., 1 + clip_eps_high]; null: algo.clip_eps. DAPO's clip-higher: 0.28 with a low side
    of 0.2."""
    clip_ratio_c: float | None = None
    """Dual clip (ppo only): a negative advantage's loss is at most clip_ratio_c x |A| however large the ratio (Ye et
    al. 2020; verl uses 3); null: off."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal carries no gradient; drop it and sample more prompts
    (up to rollout.max_refill_passes more rollouts) until rollout.num_prompts groups differ."""
    mask_truncated: bool = False
    """Answers cut off at rollout.max_tokens (finish reason length) are left out of the loss, their group's baseline
    still counting them (DAPO's overlong filtering)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: an answer longer than rollout.max_tokens - overlong_buffer loses
    algo.overlong_penalty x (its excess / overlong_buffer) of reward, linearly to the whole penalty at
    rollout.max_tokens; 0: off."""
    overlong_penalty: float = 1.0
    """The largest overlong punishment (a reward of this size), reached at rollout.max_tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the mean entropy of the sampling distribution (aggregated as the
    loss); 0: the entropy is only measured."""
    correction: str = "none"
    """Training/inference mismatch correction: none (PPO ratio against the engine's logprobs), tis (truncated importance
    weights), mis (masked importance weights)."""
    correction_level: str = "token"
    """Importance weight per token, or per sequence (the product over its tokens)."""
    tis_cap: float = 2.0
    """TIS: importance weights are truncated at this value."""
    mis_low: float = 0.5
    """MIS: weights below this are masked (the token or sequence is dropped)."""
    mis_high: float = 2.0
    """MIS: weights above this are masked."""
    mismatch_band: float = 1.1
    """Monitor: report the fraction of tokens and sequences whose ratio p_trainer / p_engine lies outside [1/band,
    band]."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy (the initial weights); 0: no reference, no KL."""
    kl_estimator: str = "k3"
    """KL estimator per token, log r = logp_ref - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    kl_in_reward: bool = False
    """reinforce_pp: fold kl_coef x the KL estimate into each token's return (REINFORCE++) instead of adding it to the
    loss."""
    num_mini_batches: int = 1
    """Each step's sequences, shuffled (seeded by rollout.seed, the step and the epoch), in this many mini-batches,
    each one optimizer step (verl's ppo_mini_batch_size as a count); must divide rollout.num_prompts x
    rollout.num_samples."""
    num_epochs: int = 1
    """Passes over each step's sequences (verl's ppo_epochs, TRL's num_iterations): num_mini_batches x num_epochs
    optimizer steps a step, each counted by the learning-rate schedule."""
    old_logprobs: str = "engine"
    """The ratio's old policy (docs/algorithms.md): engine (the engine's sampling log-probs: exact for one
    optimizer step a step), recompute (the trainer's before the step's first update, one extra forward pass: verl,
    OpenRLHF), decoupled (that recomputed proximal policy anchors the clip, and the behaviour ratio proximal /
    engine is corrected by algo.correction's TIS or MIS: AReaL's decoupled PPO)."""
    router_replay: bool = False
    """MoE models: the trainer routes every token to the experts the engine routed it to (routing replay, R3: Ma et
    al. 2025), its router weights still its own, so the ratio is not dominated by tokens whose routing flipped
    between rollout and training (docs/mismatch.md). The engine captures each token's experts; a Qwen3-MoE model."""

    @property
    def clip_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    def check(self) -> None:
        positive(self, "algo", "num_steps")
        non_negative(self, "algo", "clip_eps", "kl_coef", "overlong_buffer", "overlong_penalty", "entropy_coef")
        one_of(self, "algo", "mode", MODES)
        one_of(self, "algo", "advantage", ADVANTAGES)
        one_of(self, "algo", "policy_loss", POLICY_LOSSES)
        one_of(self, "algo", "loss_aggregation", LOSS_AGGREGATIONS)
        one_of(self, "algo", "correction", ["none", "tis", "mis"])
        one_of(self, "algo", "correction_level", ["token", "sequence"])
        one_of(self, "algo", "kl_estimator", ["k1", "k2", "k3"])
        one_of(self, "algo", "old_logprobs", OLD_LOGPROBS)
        positive(self, "algo", "num_mini_batches", "num_epochs")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise bad(f"algo.{key}", getattr(self, key), "must be in [0, 1]")
        self._check_old_logprobs()
        self._check_clip()
        if self.kl_in_reward and self.advantage != "reinforce_pp":
            raise bad("algo.kl_in_reward", True, f"folds the KL into REINFORCE++'s token returns; valid with "
                      f"algo.advantage=reinforce_pp (algo.advantage={self.advantage} takes the KL in the loss)",
                      fix={"algo.advantage": "reinforce_pp"})
        if self.kl_in_reward and self.kl_coef == 0:
            raise bad("algo.kl_in_reward", True, "needs algo.kl_coef > 0 (the KL's weight in the return)")
        if self.tis_cap < 1:
            raise bad("algo.tis_cap", self.tis_cap, "must be >= 1 (weights are truncated at it)")
        if not 0 <= self.mis_low <= 1 <= self.mis_high:
            raise bad("algo.mis_low", f"{self.mis_low}..{self.mis_high}",
                      "need 0 <= algo.mis_low <= 1 <= algo.mis_high (the band must hold the ratio 1)")
        if self.mismatch_band <= 1:
            raise bad("algo.mismatch_band", self.mismatch_band, "must be > 1 (the band is [1/band, band])")

    @property
    def num_updates(self) -> int:
        """Optimizer steps a step."""
        return self.num_mini_batches * self.num_epochs

    @property
    def recomputes_proximal(self) -> bool:
        """Whether a step scores its sequences before its first update (job/updates.py): recompute always;
        decoupled with more than one update (with one, the forward's own detached log-probs are that policy)."""
        return self.old_logprobs == "recompute" or (self.old_logprobs == "decoupled" and self.num_updates > 1)

    def _check_old_logprobs(self) -> None:
        if self.old_logprobs == "engine" and self.num_updates > 1:
            raise bad("algo.old_logprobs", "engine", f"is the old policy of one optimizer step, and algo."
                      f"num_mini_batches={self.num_mini_batches} x algo.num_epochs={self.num_epochs} take "
                      f"{self.num_updates} a step: after the first, the policy is no longer the one the engine "
                      "sampled from; valid with them: recompute or decoupled", fix={"algo.old_logprobs": "recompute"})
        if self.old_logprobs == "recompute" and self.correction != "none":
            raise bad("algo.old_logprobs", "recompute", f"anchors the ratio at the recomputed policy with no "
                      f"behaviour correction, and algo.correction={self.correction} asks for one; valid with it: "
                      "decoupled (the correction on proximal / engine)", fix={"algo.old_logprobs": "decoupled"})
        if self.old_logprobs == "decoupled" and self.correction == "none":
            raise bad("algo.old_logprobs", "decoupled", "corrects the behaviour ratio (proximal / engine) by "
                      "algo.correction, which is none; valid with it: algo.correction=tis or mis, or "
                      "algo.old_logprobs=recompute", fix={"algo.correction": "tis"})

    def _check_clip(self) -> None:
        low, high = 1 - self.clip_low, 1 + self.clip_high
        for key in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise bad(f"algo.{key}", value, f"must be >= 0: it makes the ratio's clip range [1 - clip_eps_low, "
                          f"1 + clip_eps_high] = [{low:g}, {high:g}]" + (", low > high" if low > high else "") +
                          "; e.g. DAPO's clip-higher is clip_eps_low=0.2, clip_eps_high=0.28",
                          fix={"algo.clip_eps_low": 0.2, "algo.clip_eps_high": 0.28})
        if self.clip_low > 1:
            raise bad("algo.clip_eps_low", self.clip_low, f"the clip range's lower end 1 - {self.clip_low:g} is "
                      "below 0, where no ratio lies; valid: 0..1 (1: no lower clip)")
        if self.clip_ratio_c is not None:
            if self.policy_loss != "ppo":
                raise bad("algo.clip_ratio_c", self.clip_ratio_c, f"the dual clip bounds PPO's clipped loss; "
                          f"algo.policy_loss={self.policy_loss} has none to bound. Valid with it: null",
                          fix={"algo.clip_ratio_c": None})
            if self.clip_ratio_c <= 1:
                raise bad("algo.clip_ratio_c", self.clip_ratio_c, "must be > 1 (a bound on the ratio of a "
                          "negative advantage, above the clip), e.g. 3; or null for no dual clip",
                          fix={"algo.clip_ratio_c": 3})
