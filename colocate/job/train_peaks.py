"""The train step's memory on one trainer rank, from the config: the shape of its largest micro-batch, and the peaks
of its forward+backward and of AdamW's step over the resident state (trainer/step_moments.py does the arithmetic).
Importable without vLLM or Ray: a GPU check on a machine with torch and transformers alone calls it.

    peaks = predict_train_peaks(cfg, dims, device="cuda")
    peaks.resident_bytes            # fp32 parameters + AdamW's moments, this rank's shard (gradients released)
    peaks.forward_backward_bytes    # the forward+backward's peak over the resident state
    peaks.optimizer_step_bytes      # AdamW's step over the resident state: the gradients and its temporaries

The step the config pictures: micro-batches of train_micro_batch_shape (a PROMPT_TOKENS prompt and
`rollout.max_tokens` of answer, `trainer.micro_batch_size` rows, or one packed row of the token budget), as many
per rank as `rollout.num_prompts x rollout.num_samples` sequences dealt over the trainer ranks need.
`forward_backward_bytes` is the step's first micro-batch (all of a step of one), whose gradients build up as its
activations go; the micro-batches after it run beside every gradient (they accumulate): `accumulating_bytes`,
part of the step's peak only when the step has more than one (`micro_batches`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from colocate.config import JobConfig
from colocate.models.dims import ModelDims, num_adapter_params, trainer_state_bytes
from colocate.trainer.batching import attention_implementation
from colocate.trainer.step_memory import head_input_bytes_per_token, logprob_pass_peaks
from colocate.trainer.step_moments import (
    MLP_BACKWARD_TEMPORARIES,
    StepSetting,
    optimizer_step_parts,
    peak_moment,
    step_moments,
)

PROMPT_TOKENS = 64
OPTIMIZER_STEP = "optimizer step"
LATER = " (micro-batch 2 on)"


@dataclass(frozen=True)
class TrainPeaks:
    """One trainer rank's train step, in bytes (docs/preflight.md, "The train step")."""

    resident_bytes: int  # fp32 parameters + AdamW's two moments (+ LoRA's frozen base), this rank's shard
    forward_backward_bytes: int  # the first micro-batch's forward+backward peak over the resident state
    optimizer_step_bytes: int  # AdamW's step over the resident state: the gradients and its temporaries
    accumulating_bytes: int  # a later micro-batch's forward+backward peak, beside every gradient
    micro_batches: int  # per rank per step, as pictured
    micro_batch_shape: tuple[int, int, bool]  # rows, tokens per row, attention mask materialised
    moments: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> parts, every moment of the step

    @property
    def forward_backward_moment(self) -> str:
        """The first micro-batch's largest moment ("backward: layer 3", ...)."""
        return peak_moment(self._first())[0]

    @property
    def forward_backward_parts(self) -> dict[str, int]:
        return peak_moment(self._first())[1]

    @property
    def optimizer_step_parts(self) -> dict[str, int]:
        return self.moments[OPTIMIZER_STEP]

    def _first(self) -> dict[str, dict[str, int]]:
        return {name: parts for name, parts in self.moments.items()
                if name != OPTIMIZER_STEP and not name.endswith(LATER)}

    @property
    def step_bytes(self) -> int:
        """The step's peak over the resident state."""
        return sum(self.peak_parts.values())

    @property
    def peak_moment(self) -> str:
        return peak_moment(self.moments)[0]

    @property
    def peak_parts(self) -> dict[str, int]:
        """The parts of the step's largest moment."""
        return peak_moment(self.moments)[1]


def train_micro_batch_shape(cfg: JobConfig, device: str = "cpu") -> tuple[int, int, bool]:
    """(rows, tokens per row, attention mask materialised) of the largest micro-batch the trainer runs
    (trainer/batching.py). A sequence is bounded by rollout.max_tokens of answer; its prompt is not known before
    the task runs, so PROMPT_TOKENS is a generous guess (data.max_prompt_tokens when set), both capped by the
    engine's context. With a token budget the micro-batch holds at most the budget's tokens."""
    trainer = cfg.trainer
    longest = _longest_sequence(cfg)
    tokens = trainer.micro_batch_size * longest
    if trainer.max_tokens_per_micro_batch is not None:
        tokens = min(tokens, trainer.max_tokens_per_micro_batch) if not trainer.pack_sequences \
            else trainer.max_tokens_per_micro_batch
    if trainer.pack_sequences:
        return 1, tokens, attention_implementation(trainer, device) != "flash_attention_2"
    rows = max(1, tokens // longest)
    return rows, longest, rows > 1


def _longest_sequence(cfg: JobConfig) -> int:
    prompt = cfg.data.max_prompt_tokens or PROMPT_TOKENS
    return min(cfg.engine.max_model_len, prompt + cfg.rollout.max_tokens)


def micro_batches_per_step(cfg: JobConfig, shape: tuple[int, int, bool]) -> int:
    """The micro-batches a rank runs in a step of `rollout.num_prompts x rollout.num_samples` sequences, each of
    the longest length (a packed row holds as many as its budget does)."""
    rows, length, _ = shape
    per_micro_batch = max(1, length // _longest_sequence(cfg)) if cfg.trainer.pack_sequences else rows
    sequences = math.ceil(cfg.rollout.num_prompts * cfg.rollout.num_samples / cfg.placement.num_trainer_ranks)
    return max(1, math.ceil(sequences / per_micro_batch))


def step_setting(cfg: JobConfig, dims: ModelDims, device: str) -> StepSetting:
    return StepSetting(compute_bytes=2 if cfg.trainer.mixed_precision else 4, temperature=cfg.rollout.temperature,
                       top_p=cfg.rollout.top_p, chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                       checkpointed=cfg.trainer.activation_checkpointing,
                       world_size=cfg.placement.num_trainer_ranks, device=device,
                       entropy_grad=cfg.algo.entropy_coef > 0, adapter_params=num_adapter_params(cfg, dims),
                       fp32_head=cfg.trainer.fp32_lm_head)


def reference_moment(cfg: JobConfig, dims: ModelDims, setting: StepSetting,
                     shape: tuple[int, int, bool]) -> dict[str, int]:
    """algo.kl_coef > 0 without LoRA: the reference policy (trainer/reference.py), offloaded but for its forwards
    at the start of a train step, before the policy's activations or gradients exist. Its shard in the compute
    dtype, one group unsharded at a time (two with more than one rank: the next all-gather waits beside it), and a
    forward without gradients: the larger of a layer's MLP and the log-prob pass's forward."""
    if cfg.algo.kl_coef <= 0 or setting.adapter_params:
        return {}
    c, world = setting.compute_bytes, setting.world_size
    rows, length, _ = shape
    tokens = rows * length
    largest_group = max(dims.layer_params, dims.vocab_size * dims.hidden_size)
    # trainer.fp32_lm_head: the reference's head makes fp32 logits too (its fp32 copy of lm_head is freed before
    # the logits' temporaries, as the policy's forward measured: trainer/step_moments.py)
    logits_bytes = 4 if setting.fp32_head else c
    forward_pass, _ = logprob_pass_peaks(dims, num_tokens=tokens, compute_bytes=logits_bytes,
                                         temperature=setting.temperature, top_p=setting.top_p,
                                         chunk_tokens=setting.chunk_tokens)
    layer = tokens * c * ((MLP_BACKWARD_TEMPORARIES + 1) * dims.intermediate_size + 2 * dims.hidden_size)
    return {"reference policy (compute-dtype shard)": c * dims.num_params // world,
            "reference unsharded groups": c * largest_group * (2 if world > 1 else 1),
            "reference forward (no gradients)": max(layer, forward_pass)
            + tokens * head_input_bytes_per_token(dims, compute_bytes=c)}


def predict_train_peaks(cfg: JobConfig, dims: ModelDims, *, device: str) -> TrainPeaks:
    """One trainer rank's train step under `cfg` on `device` ("cuda" or "cpu"): see the module docstring."""
    setting = step_setting(cfg, dims, device)
    shape = train_micro_batch_shape(cfg, device)
    rows, length, masked = shape
    micro_batches = micro_batches_per_step(cfg, shape)
    first = step_moments(dims, setting, rows=rows, length=length, masked=masked)
    if reference := reference_moment(cfg, dims, setting, shape):
        first["reference forward"] = reference
    later = step_moments(dims, setting, rows=rows, length=length, masked=masked, accumulating=True)
    optimizer = optimizer_step_parts(dims, setting)
    moments = {**first, **({name + LATER: parts for name, parts in later.items()} if micro_batches > 1 else {}),
               OPTIMIZER_STEP: optimizer}
    kept, _ = trainer_state_bytes(cfg, dims)
    return TrainPeaks(resident_bytes=kept // setting.world_size,
                      forward_backward_bytes=sum(peak_moment(first)[1].values()),
                      optimizer_step_bytes=sum(optimizer.values()),
                      accumulating_bytes=sum(peak_moment(later)[1].values()), micro_batches=micro_batches,
                      micro_batch_shape=shape, moments=moments)


def micro_batch_bytes(cfg: JobConfig, dims: ModelDims, device: str = "cpu",
                      shape: tuple[int, int, bool] | None = None, *, accumulating: bool = False) -> dict[str, int]:
    """The forward+backward peak's parts over the resident state, gradients included, for one micro-batch of
    `shape` (rows, tokens per row, mask materialised; default: the largest the config allows) at the config's
    world size: the step's first micro-batch, or (`accumulating`) one after it, beside every gradient."""
    setting = step_setting(cfg, dims, device)
    rows, length, masked = shape or train_micro_batch_shape(cfg, device)
    return peak_moment(step_moments(dims, setting, rows=rows, length=length, masked=masked,
                                    accumulating=accumulating))[1]
