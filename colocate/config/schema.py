"""The job's configuration as typed dataclasses, one per section, each with the checks of its own fields.

Every field carries a docstring (the string literal under it, in lines within 120 columns), which `colocate
config-docs` joins into one paragraph per key of the table in docs/config.md (config/docs.py). YAML and
`key=value` overrides become a JobConfig once, at the edge (config/loading.py); library code only ever sees
JobConfig.

    cfg.check()   # each section's check(), then those across sections; ConfigError naming the first bad key

Checked here: what needs no machine, no file and no user code. What needs them (the task's module, data files,
the model, the devices, the paths the job writes) is checked in one place, colocate/job/checks.py, which
`colocate validate` and `colocate launch` both call. Errors are ConfigError: `key=value is invalid: <valid>`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from colocate.config.algo import GREEDY_TEMPERATURE, GROUP_ADVANTAGES, OVERLAPPED_MODES, AlgoConfig
from colocate.config.critic import POLICY, CriticConfig
from colocate.config.fields import bad, non_negative, one_of, overrides, positive
from colocate.config.reward_model import RewardModelConfig, reward_model_spec, reward_models_in
from colocate.errors import ConfigError


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model directory or hub id; empty builds the embedded `preset` into `cache_dir`."""
    preset: str = "tiny"
    """Embedded model preset when `path` is empty, built once into `cache_dir`."""
    cache_dir: str = "~/.cache/colocate/models"
    """Where embedded presets are built once and reused."""
    seed: int = 0
    """Seed of the embedded model's random initialisation."""


# the embedded reward models a bare `model:` / `judge:` is pointed to (colocate/models/sources.py builds them)
EMBEDDED_REWARD_MODELS = {"model": "tiny-rm", "judge": "tiny"}

# vLLM 0.32's accepted max_lora_rank values (vllm/config/lora.py, MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORA_RANK = VLLM_LORA_RANKS[-1]
# The projections vLLM wraps with LoRA layers (column-parallel q/k/v/gate/up, packed into qkv_proj and
# gate_up_proj; row-parallel o/down), each with a TP rule in the sync (sync/reshard.py); "all-linear": all of them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"


def engine_lora_rank(trainer_rank: int, engine_rank: int = 0) -> int:
    """The rank of the engine's adapter buffers: engine.max_lora_rank when given, else the smallest of vLLM's ranks
    that holds the trainer's (vLLM serves an adapter of a smaller rank in larger buffers, the rows of A and columns
    of B past it zero: engine/lora.py). 0 without LoRA."""
    if engine_rank or not trainer_rank:
        return engine_rank
    return next(r for r in VLLM_LORA_RANKS if r >= trainer_rank)


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank: 0 trains every weight; > 0 freezes the base and trains rank-r adapters on trainer.lora.target_modules
    (the optimizer holds their state alone; each sync sends only them, unless the engine discards its weights:
    engine.sleep_level=2). Any rank from 1 to 512: the engine holds it in buffers of engine.max_lora_rank, its extra
    rows zero."""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is alpha / rank x B A."""
    target_modules: str = "all-linear"
    """Comma-separated projections to adapt (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; PEFT's
    suffix rule), or all-linear: every one of them the model has."""

    def check(self) -> None:
        if self.rank < 0:
            raise bad("trainer.lora.rank", self.rank, "must be >= 0 (0: no LoRA, train every weight)")
        if self.rank > MAX_LORA_RANK:
            raise bad("trainer.lora.rank", self.rank, f"valid: 0 (no LoRA) or 1 to {MAX_LORA_RANK} (vLLM's largest "
                      "max_lora_rank)")
        if not self.alpha > 0:
            raise bad("trainer.lora.alpha", self.alpha, "must be > 0")
        for target in self.targets:
            if target != ALL_LINEAR and target not in LORA_TARGETS:
                raise bad("trainer.lora.target_modules", self.target_modules,
                          f"{target!r} is not a projection the engine can adapt; valid: {ALL_LINEAR}, "
                          + ", ".join(LORA_TARGETS))

    @property
    def targets(self) -> list[str]:
        return [t.strip() for t in self.target_modules.split(",") if t.strip()]


@dataclass
class TrainerConfig:
    lr: float = 1e-3
    """AdamW learning rate (the peak, with a schedule)."""
    lr_schedule: str = "constant"
    """Learning rate over the run's optimizer steps (algo.num_steps x algo.num_updates: one a step unless
    algo.num_mini_batches or algo.num_epochs say more), after trainer.lr_warmup_steps of linear warmup: constant,
    cosine or linear decay to trainer.lr_min_ratio x lr at the last one."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warmup: optimizer step s (0-based) uses (s + 1) / (lr_warmup_steps + 1) x lr."""
    lr_min_ratio: float = 0.0
    """cosine and linear: the last step's learning rate as a fraction of trainer.lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0 disables clipping."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass on each rank; gradients accumulate over micro-batches."""
    mixed_precision: bool = False
    """FSDP2 mixed precision (bf16 compute, fp32 reduce, fp32 master weights and optimizer state): on CUDA, and on a CPU
    with native bf16 (AVX-512 BF16 or AMX)."""
    offload: str = "auto"
    """Move parameters and optimizer state out while the engine runs: true, false, or auto (only when the memory
    preflight finds the rollout would not fit beside them)."""
    offload_backend: str = "auto"
    """CUDA: torch_memory_saver (state allocated in its region, paused with a host backup), pinned (exact-size
    page-locked host buffers), or auto (torch_memory_saver when installed, else pinned). The CPU always uses a
    file-backed tier."""
    offload_dir: str = ""
    """CPU: directory of the offload file (on disk, not tmpfs); empty: the system's temporary directory."""
    num_threads: int = 1
    """Torch intra-op threads per trainer rank (CPU)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the layer there (torch's non-reentrant
    checkpoint, per layer, inside FSDP2's per-layer groups): activations fall from ~10 hidden sizes a token per layer to
    one, for ~a third more compute."""
    activation_offload: bool = False
    """With activation_checkpointing on CUDA: hold the kept layer inputs in pinned host memory (a copy each way per
    layer); the CPU has nowhere further to put them."""
    logprob_chunk_tokens: int | None = 1024
    """Tokens per chunk of the log-prob pass (lm_head, temperature, top-p, log-softmax), each chunk recomputed in the
    backward: the full [tokens, vocabulary] logits never exist at once; null: all of a micro-batch's at once."""
    fp32_lm_head: bool = False
    """Under trainer.mixed_precision: the chunked head computes its logits in fp32 from the bf16 hidden states and
    weight (as engine.fp32_lm_head does in vLLM), not rounded to bf16; costs an fp32 copy of lm_head per chunk."""
    pack_sequences: bool = False
    """A micro-batch is one row of its sequences end to end (positions restarting per sequence, attention kept inside
    each), no padding; false: one right-padded row per sequence."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a micro-batch (dynamic batch size): as many sequences as fit, packed tokens or rows x longest
    when padded, at most micro_batch_size rows padded; null: micro_batch_size sequences each. Must hold the longest
    sequence the engine can return."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self) -> None:
        positive(self, "trainer", "lr", "micro_batch_size", "num_threads")
        if self.activation_offload and not self.activation_checkpointing:
            raise bad("trainer.activation_offload", True, "offloads the checkpointed layer inputs: needs "
                       "trainer.activation_checkpointing=true", fix={"trainer.activation_checkpointing": True})
        if self.logprob_chunk_tokens is not None and self.logprob_chunk_tokens <= 0:
            raise bad("trainer.logprob_chunk_tokens", self.logprob_chunk_tokens,
                       "must be > 0 (tokens per chunk), or null for all of a micro-batch's logits at once")
        if self.fp32_lm_head and not self.mixed_precision:
            raise bad("trainer.fp32_lm_head", True, "the head already computes in fp32 without "
                      "trainer.mixed_precision=true; valid: false, or turn mixed precision on",
                      fix={"trainer.fp32_lm_head": False})
        if self.fp32_lm_head and self.logprob_chunk_tokens is None:
            raise bad("trainer.fp32_lm_head", True, "the chunked log-prob head computes it: needs "
                      "trainer.logprob_chunk_tokens > 0, e.g. 1024", fix={"trainer.logprob_chunk_tokens": 1024})
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch <= 0:
            raise bad("trainer.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch,
                       "must be > 0 (tokens per micro-batch), or null for trainer.micro_batch_size sequences each")
        non_negative(self, "trainer", "weight_decay", "grad_clip", "lr_warmup_steps")
        one_of(self, "trainer", "lr_schedule", ["constant", "cosine", "linear"])
        if not 0 <= self.lr_min_ratio <= 1:
            raise bad("trainer.lr_min_ratio", self.lr_min_ratio, "must be in [0, 1] (a fraction of trainer.lr)")
        one_of(self, "trainer", "offload", ["auto", "true", "false"])
        one_of(self, "trainer", "offload_backend", ["auto", "pinned", "torch_memory_saver"])
        self.lora.check()


@dataclass
class EngineConfig:
    tp: int = 2
    """Tensor-parallel size of each vLLM engine; must divide placement.num_slots."""
    dtype: str = "bfloat16"
    """Engine weight dtype: bfloat16, float16 or float32."""
    max_model_len: int = 128
    """Longest prompt + response the engine accepts."""
    kv_cache_gib: float = 0.125
    """CPU: KV cache size per engine worker in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.5
    """CUDA: fraction of GPU memory vLLM may use for weights + KV cache."""
    enforce_eager: str = "auto"
    """Skip graph capture / compilation: true (fast start), false (CUDA graphs, compiled), auto (true on the CPU, false
    on CUDA)."""
    max_num_seqs: int = 0
    """Most sequences the engine decodes at once; 0 keeps vLLM's default."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a shared prefix: the samples of one prompt share its prefill."""
    max_lora_rank: int = 0
    """With trainer.lora.rank > 0: the largest adapter rank the engine holds (vLLM's max_lora_rank: 1, 8, 16, 32, 64,
    128, 256, 320 or 512, at least the trainer's); 0: the smallest of them that holds the trainer's rank."""
    expert_parallel: bool = False
    """MoE models: split the experts across each engine's TP workers, each expert whole (vLLM enable_expert_parallel),
    instead of splitting every expert's intermediate dimension."""
    extra_args: str = ""
    """Other vLLM engine arguments as a JSON object, e.g. {"block_size": 32}; names are checked against vLLM's
    EngineArgs before anything starts."""
    sleep_level: str = "auto"
    """Engine sleep while training: 0 stays awake, 1 keeps a host copy of the weights, 2 discards them (the sync
    restores them), auto the least that lets the training phase fit (memory preflight)."""
    sleep_backend: str = "auto"
    """auto (vllm on CUDA, portable on CPU), vllm (vLLM sleep mode, CUDA only), portable (release storages)."""
    seed: int = 0
    """Engine sampling seed."""
    fp32_lm_head: bool = False
    """bf16/fp16 engines: compute lm_head's logits in fp32 from the model-dtype hidden states and weight (vLLM's
    head_dtype=float32), as trainer.fp32_lm_head does; the weight and the sync stay in engine.dtype."""
    native_rotary: bool = False
    """Rotary embeddings through vLLM's torch implementation (its rotary kernel off: compilation_config custom_ops
    -rotary_embedding), the arithmetic of the trainer's transformers model: on the CPU in fp32 at TP=1 the engine's
    forward is then the trainer's bit for bit for heads of 64 (docs/mismatch.md)."""
    batch_invariant: bool = False
    """vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1): a sequence's log-probs do not depend on what else is
    in the batch. vLLM 0.32 has them for CUDA (Triton kernels on Ampere, cuBLAS settings on Hopper and Blackwell),
    ROCm and XPU, not for the CPU; co-located placements only."""

    def check(self) -> None:
        positive(self, "engine", "tp", "max_model_len")
        non_negative(self, "engine", "max_num_seqs")
        if self.max_lora_rank and self.max_lora_rank not in VLLM_LORA_RANKS:
            raise bad("engine.max_lora_rank", self.max_lora_rank,
                      "valid: 0 (the smallest that holds the trainer's LoRA rank) or one of "
                      + ", ".join(map(str, VLLM_LORA_RANKS)))
        one_of(self, "engine", "dtype", ["bfloat16", "float16", "float32"])
        one_of(self, "engine", "sleep_level", ["auto", "0", "1", "2"])
        one_of(self, "engine", "sleep_backend", ["auto", "vllm", "portable"])
        one_of(self, "engine", "enforce_eager", ["auto", "true", "false"])
        if self.fp32_lm_head and self.dtype == "float32":
            raise bad("engine.fp32_lm_head", True, "a float32 engine's head already computes in fp32; valid: false, "
                      "or engine.dtype=bfloat16", fix={"engine.fp32_lm_head": False})
        extra = engine_extra_args(self)
        overridden = extra.get("hf_overrides")
        if self.fp32_lm_head and isinstance(overridden, dict) and "head_dtype" in overridden:
            raise bad("engine.extra_args", self.extra_args, "its hf_overrides sets head_dtype, which "
                      "engine.fp32_lm_head=true sets to float32; drop one of them")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("engine.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        if self.kv_cache_gib <= 0:
            raise bad("engine.kv_cache_gib", self.kv_cache_gib, "must be > 0")


@dataclass
class SyncConfig:
    bucket_mb: float = 0.0
    """Size of one bucket slot in MiB; 0 sizes it to the largest layer."""
    num_bucket_slots: int = 2
    """Bucket slots in the ring: >= 2 lets the next layer be packed while the engine loads the previous."""
    verify: str = "checksum"
    """After each sync: checksum (ring: every written range, checked before its bucket loads; in place: every engine
    parameter still where the trainers write), full (compare every engine tensor), or none (docs/integrity.md)."""
    method: str = "auto"
    """gather: each layer is all-gathered over the trainers' process group and every rank hands the TP slice of the
    engine worker on its own device to that worker's ring (the CUDA protocol; runs on the CPU with gloo and shared
    memory); in_place (CPU): trainers write into the engine's parameters, kept in shared memory; ring (CPU): every
    rank writes its rows into every worker's ring; broadcast (split placement, placement.engine_slots > 0): the
    trainers all-gather each layer and one rank per TP rank broadcasts its slice to that TP worker of every engine
    over a process group; auto: broadcast when split, else in_place on CPU and gather on CUDA."""
    delta: str = "auto"
    """Send only what changed (docs/delta.md): true (the broadcast sends each bucket slice's changed elements since the
    last sync, found bit for bit against a weight store in host memory on both sides, applied by selective
    overwrite), false (every byte, every sync), auto (true for the split placement's broadcast, where the bytes cross
    devices or nodes; false co-located, where the copy runs at memory bandwidth and finding the changes costs more than
    it saves: measured in docs/delta.md)."""

    carrier: str = "group"
    """The split placement's broadcast travels over: group (a process group per TP rank: gloo on the CPU, NCCL on
    GPUs), or directory (files in sync.carrier_dir, which the trainers and every engine worker share: for engines
    that reach the trainers only through shared storage; each file checksummed, a torn one refused)."""
    carrier_dir: str = ""
    """sync.carrier=directory: the shared directory the sync's files go through (sync/directory_carrier.py)."""

    def check(self) -> None:
        positive(self, "sync", "num_bucket_slots")
        one_of(self, "sync", "delta", ["auto", "true", "false"])
        one_of(self, "sync", "carrier", ["group", "directory"])
        if self.carrier == "directory" and not self.carrier_dir:
            raise bad("sync.carrier_dir", "", "sync.carrier=directory sends the sync through files in this "
                      "directory, and none is given; valid: a directory the trainers and engines share")
        non_negative(self, "sync", "bucket_mb")
        one_of(self, "sync", "verify", ["checksum", "full", "none"])
        one_of(self, "sync", "method", ["auto", "broadcast", "gather", "in_place", "ring"])
        if self.num_bucket_slots < 2:
            raise bad("sync.num_bucket_slots", self.num_bucket_slots,
                       "must be >= 2 (one slot is packed while the engine loads the other)")


@dataclass
class RolloutConfig:
    task: str = "copy"
    """Built-in toy task (copy, reverse, add) or a dotted path `module:function` returning a Task."""
    reward_fn: str = ""
    """Dotted path `module:function(prompt, response, answer) -> float`; empty uses the task's reward."""
    rewards: str = ""
    """Weighted sum of rewards, e.g. math:1.0,format:0.1: built-ins math, exact, format, char, module:function, or a
    reward model served by the job, model:PATH (a sequence classifier) or judge:PATH (a generative judge; section
    reward_model) (weight 1 when omitted); each one's mean is logged as reward_<name>_mean. Empty: rollout.reward_fn or
    the task's reward."""
    source_rewards: str = ""
    """Rewards per data source, a JSON object of source -> a rollout.rewards spec, e.g. {"gsm8k": "math:1.0,format:0.1",
    "*": "exact"} ("*": every source not listed); each row's data.source_key column picks its entry. Replaces
    rollout.rewards; empty: off."""
    num_prompts: int = 16
    """Prompts per RL step."""
    num_samples: int = 8
    """Responses sampled per prompt (the GRPO group size)."""
    max_tokens: int = 3
    """Longest response in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling probability mass."""
    ignore_eos: bool = False
    """Answers run to rollout.max_tokens (or the context) whatever they sample, EOS included: for benchmarks and for
    stress tests of long answers (verl's rollout.ignore_eos)."""
    task_length: int = 3
    """Operand length (characters) of the toy tasks."""
    seed: int = 0
    """Seed of the prompt stream."""
    oversample: float = 1.0
    """Over-sampling: groups in flight per step, as a multiple of num_prompts; the rollout stops once num_prompts groups
    are complete (exactly that many are trained) and the rest are carried or dropped (rollout.leftover)."""
    leftover: str = "carry"
    """Groups a step does not train (unfinished, or complete beyond num_prompts): carry (they keep their tokens and go
    on next step) or drop."""
    partial_tokens: int = 0
    """Partial rollout: the most new tokens an answer gets in one pass (a step makes another pass only while none of its
    groups is complete); an answer still unfinished keeps its tokens and continues next step under the newer policy. 0:
    answers run to their end within the step."""
    max_lag: int = 1
    """An answer (finished or not) whose oldest token was sampled more than this many policy versions ago is restarted
    from its prompt; tokens within the lag are trained, corrected by the loss's ratio to their behaviour logprobs."""
    update_in_pass: str = "never"
    """algo.mode=async: a weight update enters the pass in flight between two engine steps (never: it waits for the
    pass to end); the pass's later tokens are the new policy's (docs/async.md). keep: the answers in flight keep the
    KV cache the old weights computed; recompute: the engine computes it again with the new weights first."""
    stream: bool = False
    """algo.mode=async with rollout.update_in_pass: stream the rollout (docs/async.md). Each engine's pass takes new
    requests while it runs (new prompts in the places of the groups a step took, an answer's next segment or turn),
    and every answer's result comes back as it finishes: the trainer takes complete groups without waiting for a
    pass to end, and the engines wait for the trainer only where the pool is full of complete groups (the lag cap
    and rollout.oversample bound it)."""
    speculative: str = ""
    """Speculative decoding in rollout (docs/rollout.md): ngram (vLLM's prompt lookup: drafts copied from the answer's
    own context, no draft model to keep in sync with the policy); empty: none. CUDA only (vLLM's CPU build samples
    off the policy's distribution with drafts); temperature and top_p 1, so the sampling log-probs are the
    policy's."""
    speculative_tokens: int = 4
    """rollout.speculative: draft tokens proposed a step, each verified by the policy in the same forward pass."""
    env: str = ""
    """Multi-turn episodes (docs/environments.md): an environment, built-in (copy_turns) or `module:factory` returning
    an object with reset(sample) and step(action_text); each answer is an episode of turns, the engine's tokens and the
    environment's observations, up to rollout.max_turns turns within rollout.max_tokens tokens; its reward is the
    environment's. Empty: single-turn answers scored by the reward function."""
    max_turns: int = 4
    """rollout.env: the most turns (model answers) an episode has; the episode ends sooner when the environment says
    done or its tokens run out."""
    turn_stop: str = ""
    """rollout.env: text that ends a turn of the model where it appears, besides EOS, kept in the turn, e.g.
    </tool_call> so the model's turn ends with its call; matched as the tokens the tokenizer gives it (exact for a
    special token, as Qwen's </tool_call>, and for character vocabularies). Empty: turns end at EOS or
    rollout.max_turn_tokens."""
    max_turn_tokens: int = 0
    """rollout.env: the most tokens of one turn of the model; reaching it ends the turn (the environment steps on what
    it has). 0: a turn ends only at the model's EOS or when the episode's rollout.max_tokens run out."""
    turn_reward: str = "sum"
    """rollout.env: an episode's reward from its turns' rewards: sum, or last (only the final turn's)."""
    env_errors: str = "fail"
    """rollout.env: an environment that raises, hangs past rollout.env_timeout_s or returns the wrong type: fail (the
    step stops, naming the sample and turn) or drop (that sample's group is dropped and counted, the step goes on)."""
    env_timeout_s: float = 30.0
    """rollout.env: the longest one reset or step may take; 0: no bound."""
    env_workers: int = 0
    """rollout.env: Ray actors that hold the environments (each episode's in one), stepping a pass's turn ends in
    parallel so a slow environment does not hold the engines; 0: in the controller's process, one call at a time."""
    max_refill_passes: int = 4
    """algo.dynamic_sampling: the most extra rollouts a step makes to replace the groups it dropped (each asks the pool
    for the missing groups over the fraction informative so far); a step still short after them trains the informative
    groups it has, and says so in its metrics."""

    def check(self) -> None:
        positive(self, "rollout", "num_prompts", "num_samples", "max_tokens", "task_length", "top_p")
        non_negative(self, "rollout", "temperature", "partial_tokens", "max_lag", "max_refill_passes")
        if self.top_p > 1:
            raise bad("rollout.top_p", self.top_p, "must be in (0, 1]")
        if self.oversample < 1:
            raise bad("rollout.oversample", self.oversample,
                       "must be >= 1 (a multiple of rollout.num_prompts groups in flight)")
        one_of(self, "rollout", "leftover", ["carry", "drop"])
        one_of(self, "rollout", "update_in_pass", ["never", "keep", "recompute"])
        positive(self, "rollout", "speculative_tokens")
        self._check_speculative()
        positive(self, "rollout", "max_turns")
        non_negative(self, "rollout", "env_timeout_s", "max_turn_tokens", "env_workers")
        if self.turn_stop and not self.env:
            raise bad("rollout.turn_stop", self.turn_stop, "ends a turn of rollout.env's episodes, and rollout.env is "
                      "empty; set rollout.env, or leave rollout.turn_stop empty", fix={"rollout.turn_stop": ""})
        if self.env_workers and not self.env:
            raise bad("rollout.env_workers", self.env_workers, "holds rollout.env's environments, and rollout.env is "
                      "empty; set rollout.env, or rollout.env_workers=0", fix={"rollout.env_workers": 0})
        one_of(self, "rollout", "turn_reward", ["sum", "last"])
        one_of(self, "rollout", "env_errors", ["fail", "drop"])
        if self.partial_tokens and self.leftover == "drop":
            raise bad("rollout.leftover", "drop", "partial rollout (rollout.partial_tokens > 0) carries unfinished "
                       "answers over; valid with it: carry", fix={"rollout.leftover": "carry"})
        if self.rewards and self.reward_fn:
            raise bad("rollout.rewards", self.rewards, "rollout.reward_fn is set too; give one of them "
                       "(a module:function can be a component of rollout.rewards)")
        if self.source_rewards and (self.rewards or self.reward_fn):
            key = "rollout.rewards" if self.rewards else "rollout.reward_fn"
            raise bad(key, self.rewards or self.reward_fn, "rollout.source_rewards is set too, and replaces it; "
                      "give the rewards of every source not listed as its \"*\" entry", fix={key: ""})
        if self.env:
            self._check_env()

    def _check_speculative(self) -> None:
        if not self.speculative:
            return
        if self.speculative not in SPECULATIVE_METHODS:
            raise bad("rollout.speculative", self.speculative, "valid: ngram (prompt lookup), or empty; a draft "
                      "model or EAGLE head would have to be trained and synced beside the policy, which colocate "
                      "does not do", fix={"rollout.speculative": ""})
        if self.temperature != 1.0 or self.top_p != 1.0:
            # vLLM 0.32's rejection sampler returns some accepted draft tokens' processed log-probs as 0.0 (seen
            # on the CPU build: 17 of 1,024 at temperature 1, none with raw log-probs), so the engine asks for raw
            # log-probs, which are the sampling distribution's only without temperature and top-p
            key, value = ("rollout.temperature", self.temperature) if self.temperature != 1.0 else \
                ("rollout.top_p", self.top_p)
            raise bad(key, value, "rollout.speculative keeps the sampling log-probs the policy's only at "
                      "temperature 1 and top_p 1 (vLLM's processed log-probs of accepted drafts are wrong); valid "
                      "with it: 1.0, or rollout.speculative empty", fix={key: 1.0})

    def _check_env(self) -> None:
        for key in ("reward_fn", "rewards"):
            if getattr(self, key):
                raise bad(f"rollout.{key}", getattr(self, key), "rollout.env is set: an episode's reward is its "
                          "environment's (rollout.turn_reward); valid with it: empty", fix={f"rollout.{key}": ""})
        if self.ignore_eos:
            raise bad("rollout.ignore_eos", True, "a turn of rollout.env ends at the model's EOS; valid with it: "
                      "false", fix={"rollout.ignore_eos": False})
        # partial rollout's passes against the lag cap: JobConfig._check_partial_rollout (it depends on the mode)


SPECULATIVE_METHODS = ("ngram",)


def partial_rollout_fix(rollout: RolloutConfig, *, mode: str, partial: int) -> dict[str, int]:
    """The least change with which every answer under partial rollout, in segments of at least `partial` tokens,
    finishes within the lag cap: a larger rollout.partial_tokens, or a larger rollout.max_lag where no segment
    size can do it (too many turns). Equal to {"rollout.partial_tokens": partial} when that fits already.

    An answer takes a pass per segment and, with rollout.env, one more per turn after the first (each turn's end
    ends a request); beyond rollout.max_lag + 1 passes (policy versions) it would be restarted forever. With
    algo.mode=one_step_off a token is a version old before its first pass, and with rollout.update_in_pass an update
    can land inside each pass, so there its segments get max_lag passes."""
    turns = rollout.max_turns - 1 if rollout.env else 0
    segments = rollout.max_lag + 1 - turns  # the most segments an answer may take
    if a_version_more(rollout, mode):
        segments = min(segments, rollout.max_lag)
    if segments >= 1:
        return {"rollout.partial_tokens": max(partial, -(-rollout.max_tokens // segments))}
    needed = -(-rollout.max_tokens // partial)
    return {"rollout.max_lag": max(turns + needed - 1, needed if a_version_more(rollout, mode) else 0)}


def a_version_more(rollout: RolloutConfig, mode: str) -> bool:
    """An answer's tokens can span one more policy version than its passes: one_step_off samples a version before
    training, and an update inside a pass (rollout.update_in_pass) splits that pass's tokens over two."""
    return mode == "one_step_off" or (mode == "async" and rollout.update_in_pass != "never")


@dataclass
class DataConfig:
    train_files: str = ""
    """Training prompts: comma-separated .jsonl or .parquet files (a YAML list works too; globs allowed); empty: the toy
    task rollout.task makes the prompts."""
    val_files: str = ""
    """Validation prompts, same format as data.train_files (read and checked; not yet evaluated during a run)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: plain text, or a list of chat messages {role, content} (rendered as
    data.chat_template says)."""
    chat_template: str = "auto"
    """How a prompt becomes the text the engine continues: auto (through the model's chat template when its tokenizer
    has one, plain text as one user message, with the generation prompt; without one, plain text as is and messages'
    contents joined by newlines), none (never a template: plain text as is, messages joined), or the path of a Jinja
    chat template file used instead of the model's (docs/data.md)."""
    chat_template_kwargs: str = ""
    """A JSON object of keyword arguments for the chat template, e.g. {"enable_thinking": false} (Qwen3's); empty:
    none."""
    answer_key: str = "answer"
    """Column holding the reference answer given to the reward; empty: no answers (the reward gets "")."""
    source_key: str = "data_source"
    """Column naming each row's source (verl's data_source): it picks the row's rewards (rollout.source_rewards), and
    training and validation metrics are reported per source; a file without it is one source."""
    max_prompt_tokens: int = 0
    """Longest prompt in tokens; 0: whatever leaves room for one response token within engine.max_model_len."""
    too_long: str = "filter"
    """A prompt longer than the limit: filter (dropped, the count logged once) or error (the job stops naming its
    row)."""
    shuffle: bool = True
    """Shuffle the rows, again every epoch (with data.seed + epoch)."""
    seed: int = 0
    """Seed of the data order."""

    def check(self) -> None:
        one_of(self, "data", "too_long", ["filter", "error"])
        non_negative(self, "data", "max_prompt_tokens")
        chat_template_kwargs(self)
        if (self.train_files or self.val_files) and not self.prompt_key:
            raise bad("data.prompt_key", "", "name the column holding the prompts, e.g. prompt",
                      fix={"data.prompt_key": "prompt"})


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate after every this many steps (pass@k on data.val_files, or with no data files on a fixed set of toy-task
    prompts); 0: never during the run."""
    at_start: bool = False
    """Also evaluate before the first step (the starting model's score)."""
    at_end: bool = False
    """Also evaluate after the last step."""
    num_samples: int = 1
    """Samples per validation prompt, the k of pass@k (with 1: pass@1 only)."""
    temperature: float = 0.0
    """Sampling temperature of the evaluation; 0 is greedy (one sample per prompt)."""
    max_tokens: int = 0
    """Longest evaluation response in tokens; 0: rollout.max_tokens."""
    max_prompts: int = 0
    """Evaluate the first this many validation prompts (the same ones every time); 0: all of them (toy tasks: 64)."""
    seed: int = 1234
    """Sampling seed of the evaluation (the same every time, so evaluations differ only by the policy); toy tasks also
    draw their prompts with it."""

    def check(self) -> None:
        non_negative(self, "eval", "every_steps", "temperature", "max_tokens", "max_prompts")
        positive(self, "eval", "num_samples")
        if self.temperature == 0 and self.num_samples > 1:
            raise bad("eval.num_samples", self.num_samples, "greedy decoding (eval.temperature=0) gives one "
                       "answer per prompt; valid: 1, or set eval.temperature > 0 for pass@k",
                      fix={"eval.num_samples": 1})


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint after every this many steps (FSDP2 shards through torch.distributed.checkpoint, the optimizer,
    every rank's RNG, the data position and unfinished answers); 0: only at the end (checkpoint.at_end)."""
    at_end: bool = True
    """Also save after the last step."""
    dir: str = ""
    """Where checkpoints go (one step_<N> folder each); empty: <logging.output_dir>/checkpoints. Several nodes: a
    directory every node sees."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete. 0 keeps all."""
    resume: str = ""
    """auto: continue from the newest complete checkpoint in checkpoint.dir (start afresh when there is none); a
    step_<N> path: continue from it; empty: start afresh. Also given as resume=... on the command line."""
    export_hf: bool = False
    """Also write a Hugging Face model (safetensors, config, tokenizer) into each checkpoint's hf/ folder (a LoRA job:
    its adapter, in PEFT's format)."""

    def check(self) -> None:
        non_negative(self, "checkpoint", "every_steps", "keep_last")


@dataclass
class FaultConfig:
    heartbeat_s: float = 1.0
    """How often the controller checks that every process of the job on its node is alive and running (a dead, zombie or
    stopped one ends the job at once, named)."""
    sync_timeout_s: float = 600.0
    """A weight sync, a sleep/wake switch or a step's metrics read that has not finished after this many seconds is a
    hang: the job stops naming its members. 0: no limit."""
    checkpoint_timeout_s: float = 1800.0
    """The same bound for a checkpoint save (and its HF export). A save writes about 12 bytes per parameter (fp32
    weights and AdamW's two moments: 91 GB for a 7B model): size it as 2 x those bytes / the storage's slowest write
    rate (docs/checkpoints.md). 0: no limit."""
    rollout_timeout_s: float = 0.0
    """The same bound for a rollout phase; 0: no limit (a rollout's length is the model's to decide)."""
    engine_timeout_s: float = 0.0
    """The engines' heartbeat: an engine whose rollout pass has not finished an engine step for this many seconds, with
    every process alive (a hung worker, a stuck device call or collective), is named in a rollout; with
    fault.engine_restarts it is replaced, else the job stops. Longer than the slowest step (a long prefill); 0: off."""
    train_timeout_s: float = 0.0
    """The same bound for a training phase; 0: no limit."""
    inject: str = ""
    """Chaos testing: SIGNAL:MEMBER:PHASE:STEP sends a signal to one process of the job as that phase of that step
    begins, e.g. SIGKILL:engine0.worker1:rollout:2, SIGKILL:trainer1:train:1, SIGSTOP:engine0.worker0:sync:1 (members:
    trainerR, engineE, engineE.workerK); several, separated by commas, each firing once in the job's life (a restart
    skips those that fired); empty: none."""
    max_restarts: int = 0
    """After a fault (a member died or hung), start the job again from its newest checkpoint (resume=auto) up to this
    many times; 0: stop with the fault."""
    engine_restarts: int = 0
    """A rollout engine whose TP worker or actor dies or stops during a rollout or an evaluation is replaced alone, up
    to this many times in the job: a new engine on its slots loads the weights the others hold from the trainers'
    weight store (sync.delta), is verified in full, and the phase's requests are generated again; the job goes on
    without a restart (docs/faults.md). Needs a split placement in algo.mode=sync with the delta's store; 0: a
    fault ends the job (or fault.max_restarts restarts it whole), as it always did."""

    def check(self) -> None:
        positive(self, "fault", "heartbeat_s")
        non_negative(self, "fault", "sync_timeout_s", "checkpoint_timeout_s", "rollout_timeout_s", "train_timeout_s",
                      "max_restarts", "engine_restarts", "engine_timeout_s")


AUTO = "auto"  # placement.engine_slots=auto: decided once, before anything reads the slots (job/split.py)


@dataclass
class PlacementConfig:
    device: str = "auto"
    """auto, cpu or cuda."""
    num_slots: int = 2
    """Device slots (GPUs, or logical CPU slots) the job holds. Co-located (engine_slots=0): each holds one trainer rank
    and one engine worker."""
    engine_slots: int | str = 0
    """0: co-located (trainers and engines take turns on every slot). N > 0: split placement: the last N slots hold only
    engines (N / engine.tp of them), the others only trainer ranks; nothing sleeps, and every sync is broadcast from the
    trainers to the engines over a process group (gloo on the CPU, NCCL on GPUs). auto: the split predicted fastest,
    decided once before any actor starts and printed with why (job/split.py): with algo.mode=one_step_off or async,
    among the multiples of engine.tp that leave the trainers a slot, the one colocate simulate predicts fastest on
    the job's GPUs (a kind it models), else the most even split; with algo.mode=sync, 0 (its phases run in turn, so
    a split would idle each side while the other works)."""
    ray_address: str = ""
    """Existing Ray cluster to join ('auto', or host:port); empty starts a local Ray."""

    def check(self) -> None:
        positive(self, "placement", "num_slots")
        if self.engine_slots != AUTO and self.engine_slots < 0:  # config/loading.py: an int or auto, nothing else
            raise bad("placement.engine_slots", self.engine_slots, "must be >= 0 (0: co-located, N: the engines' "
                      "slots of a split), or auto (the split predicted fastest)")
        one_of(self, "placement", "device", ["auto", "cpu", "cuda"])

    @property
    def split(self) -> bool:
        assert self.engine_slots != AUTO, "placement.engine_slots=auto is decided before it is read (job/split.py)"
        return self.engine_slots > 0

    @property
    def num_trainer_ranks(self) -> int:
        assert self.engine_slots != AUTO, "placement.engine_slots=auto is decided before it is read (job/split.py)"
        return self.num_slots - self.engine_slots


@dataclass
class LoggingConfig:
    output_dir: str = "outputs/default"
    """Directory for metrics.jsonl and the resolved config."""
    progress: bool = True
    """Progress on stderr: a bar with ETA on a terminal, else one plain line per step; false: nothing per step."""
    level: str = "WARNING"
    """Log level of colocate and its actors: DEBUG, INFO, WARNING, ERROR."""
    tensorboard: bool = True
    """Also write each step's scalars as TensorBoard event files, in tensorboard/ under logging.output_dir."""
    wandb: bool = False
    """Also log each step's scalars to Weights & Biases (needs the wandb package: pip install 'colocate[wandb]')."""
    wandb_project: str = "colocate"
    """Weights & Biases project of the run."""
    wandb_mode: str = "offline"
    """offline (no network: kept in wandb/ under logging.output_dir for `wandb sync`), online (needs WANDB_API_KEY)."""
    wandb_run_name: str = ""
    """Weights & Biases run name; empty: the name of logging.output_dir."""
    rollouts: int = 0
    """Dump what each step trained on to rollouts.jsonl under logging.output_dir: its first rollouts trained groups,
    every answer with its prompt, reward, advantage and per-token log-probs of both sides (docs/training.md); -1:
    every group; 0: off."""
    rollouts_max_mb: float = 512.0
    """logging.rollouts stops once rollouts.jsonl holds this many MiB (a line says so)."""

    def check(self) -> None:
        one_of(self, "logging", "level", ["DEBUG", "INFO", "WARNING", "ERROR"])
        one_of(self, "logging", "wandb_mode", ["offline", "online"])
        positive(self, "logging", "rollouts_max_mb")
        if self.rollouts < -1:
            raise bad("logging.rollouts", self.rollouts, "is the trained groups to dump a step: 0 (off), a count, "
                      "or -1 (every group)", fix={"logging.rollouts": 0})
        if self.wandb and not self.wandb_project:
            raise bad("logging.wandb_project", "", "must name a project when logging.wandb=true")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def num_engines(self) -> int:
        return (self.placement.engine_slots if self.placement.split else self.placement.num_slots) // self.engine.tp

    @property
    def longest_sequence_tokens(self) -> int:
        """The most tokens a trained sequence can have: the engine returns at most engine.max_model_len, prompt
        included, and at most rollout.max_tokens of answer after a prompt of data.max_prompt_tokens (when set)."""
        if not self.data.max_prompt_tokens:
            return self.engine.max_model_len
        return min(self.engine.max_model_len, self.data.max_prompt_tokens + self.rollout.max_tokens)

    def _longest_why(self) -> str:
        if self.longest_sequence_tokens == self.engine.max_model_len:
            return f"engine.max_model_len={self.engine.max_model_len}"
        return f"data.max_prompt_tokens={self.data.max_prompt_tokens} + rollout.max_tokens={self.rollout.max_tokens}"

    def check(self) -> None:
        """The checks that need no machine, no file and no user code: each section's own, then those across
        sections. Raises ConfigError naming the first bad key. (What needs files, user code, the model or the
        devices is `colocate.job.checks`'.)"""
        for section in dataclasses.fields(self):
            if hasattr(getattr(self, section.name), "check"):
                getattr(self, section.name).check()
        if self.placement.engine_slots == AUTO:  # the job with each value auto may take, checked as a whole
            split_choices(self)
            return
        self._check_partial_rollout()
        if self.placement.split:
            self._check_split()
        elif self.placement.num_slots % self.engine.tp:
            tp = math.gcd(self.placement.num_slots, self.engine.tp)
            raise bad("engine.tp", self.engine.tp, f"must divide placement.num_slots={self.placement.num_slots}, "
                      f"e.g. engine.tp={tp}", fix={"engine.tp": tp})
        elif self.sync.method == "broadcast":
            raise bad("sync.method", "broadcast", "is the split placement's sync (placement.engine_slots > 0); "
                      "valid co-located: auto, gather, in_place, ring", fix={"sync.method": "auto"})
        elif self.sync.carrier == "directory":
            raise bad("sync.carrier", "directory", "carries the split placement's broadcast "
                      "(placement.engine_slots > 0); a co-located sync hands its bytes over on the device; valid "
                      "co-located: group", fix={"sync.carrier": "group"})
        elif self.sync.delta == "true":
            raise bad("sync.delta", "true", "sends the changes over the split placement's broadcast "
                      "(placement.engine_slots > 0); a co-located sync (gather, in_place, ring) copies at memory "
                      "bandwidth, where finding the changes costs more than it saves (docs/delta.md); valid "
                      "co-located: auto or false", fix={"sync.delta": "auto"})
        for key, value in (("rollout.max_tokens", self.rollout.max_tokens),
                           ("data.max_prompt_tokens", self.data.max_prompt_tokens),
                           ("eval.max_tokens", self.eval.max_tokens)):
            if value >= self.engine.max_model_len:
                room = " (room to answer)" if key == "data.max_prompt_tokens" else ""
                raise bad(key, value, f"must be smaller than engine.max_model_len={self.engine.max_model_len}{room}")
        budget, longest = self.trainer.max_tokens_per_micro_batch, self.longest_sequence_tokens
        if budget is not None and budget < longest:
            raise bad("trainer.max_tokens_per_micro_batch", budget,
                       f"the longest sequence this job can train is {longest} tokens ({self._longest_why()}); "
                       f"valid: >= {longest}, or a shorter longest sequence (engine.max_model_len, or "
                       "data.max_prompt_tokens + rollout.max_tokens)",
                       fix={"trainer.max_tokens_per_micro_batch": longest})
        self._check_algo_against_sampling()
        self._check_critic()
        if self.rollout.source_rewards and not self.data.train_files:
            raise bad("rollout.source_rewards", self.rollout.source_rewards, "picks rewards by the data.source_key "
                      "column of data.train_files' rows, and there are none (a toy task); give data.train_files, or "
                      "use rollout.rewards", fix={"rollout.source_rewards": ""})
        self._check_reward_model()
        self._check_lora()
        if (self.eval.every_steps or self.eval.at_start or self.eval.at_end) and self.data.train_files \
                and not self.data.val_files:
            raise bad("data.val_files", "", "evaluation (eval.every_steps, eval.at_start, eval.at_end) of a run on "
                       "data.train_files needs validation prompts; give data.val_files or turn evaluation off")


    def _check_partial_rollout(self) -> None:
        """Every answer under partial rollout must finish within the lag cap (partial_rollout_fix); the refusal
        suggests the change that passes this check and the mode's."""
        rollout, mode, partial = self.rollout, self.algo.mode, self.rollout.partial_tokens
        fix = partial_rollout_fix(rollout, mode=mode, partial=partial) if partial else {}
        if not partial or fix == {"rollout.partial_tokens": partial}:
            return
        (key, value), = fix.items()
        valid = f"{key} >= {value}" + (", or a larger rollout.max_lag" if key == "rollout.partial_tokens" else "")
        lag, max_tokens = rollout.max_lag, rollout.max_tokens
        if mode == "one_step_off" and max_tokens > lag * partial:
            raise bad("rollout.partial_tokens", partial, f"with algo.mode=one_step_off a token is already one "
                      f"version old when trained, so an answer of rollout.max_tokens={max_tokens} must finish "
                      f"within rollout.max_lag = {lag} passes; valid: {valid}", fix=fix)
        if a_version_more(rollout, mode) and max_tokens > lag * partial:
            raise bad("rollout.partial_tokens", partial, f"with rollout.update_in_pass={rollout.update_in_pass} an "
                      f"update can land inside each pass, so an answer's tokens span one version more than its "
                      f"passes: an answer of rollout.max_tokens={max_tokens} must finish within rollout.max_lag = "
                      f"{lag} passes; valid: {valid}", fix=fix)
        if rollout.env:
            passes = rollout.max_turns - 1 + -(-max_tokens // partial)
            raise bad("rollout.max_turns", rollout.max_turns, f"with partial rollout an episode can take "
                      f"max_turns - 1 + ceil(max_tokens / partial_tokens) = {passes} passes, more than "
                      f"rollout.max_lag + 1 = {lag + 1} policy versions, and would be restarted by the lag cap; "
                      f"valid: {valid}, or fewer turns", fix=fix)
        raise bad("rollout.partial_tokens", partial, f"an answer of rollout.max_tokens={max_tokens} needs more "
                  f"than rollout.max_lag + 1 = {lag + 1} passes and would be restarted forever; valid: {valid}",
                  fix=fix)

    def _check_lora(self) -> None:
        rank, engine_rank = self.trainer.lora.rank, self.engine.max_lora_rank
        if rank and self.sync.delta == "true":
            raise bad("sync.delta", "true", f"a LoRA job (trainer.lora.rank={rank}) syncs its adapters alone, every "
                      "tensor of which changes at every step; valid with it: auto or false", fix={"sync.delta": "auto"})
        if rank and engine_rank and rank > engine_rank:
            raise bad("trainer.lora.rank", rank, f"is above engine.max_lora_rank={engine_rank}, the largest adapter "
                      f"rank the engine holds; valid: 1 to {engine_rank}, or engine.max_lora_rank=0 (then "
                      f"{engine_lora_rank(rank)}: the smallest of vLLM's ranks that holds it)",
                      fix={"engine.max_lora_rank": 0})
        if engine_rank and not rank:
            raise bad("engine.max_lora_rank", engine_rank, "applies to a LoRA job (trainer.lora.rank > 0); valid "
                      "here: 0", fix={"engine.max_lora_rank": 0})

    def _check_reward_model(self) -> None:
        specs = reward_models_in(self.rollout.rewards)
        if len(specs) > 1:
            raise bad("rollout.rewards", self.rollout.rewards, "names more than one reward model; a job serves one "
                      "(model:PATH or judge:PATH)")
        if not specs:
            return
        if not specs[0].path:
            embedded = EMBEDDED_REWARD_MODELS[specs[0].kind]
            fix = {"rollout.rewards": ",".join(
                f"{spec.kind}:{embedded}" + (f":{spec.weight:g}" if spec.weight != 1 else "")
                if (spec := reward_model_spec(item)) and not spec.path else item
                for item in self.rollout.rewards.split(","))}
            whole = f" (rollout.rewards={fix['rollout.rewards']})" if "," in self.rollout.rewards else ""
            raise bad("rollout.rewards", self.rollout.rewards, f"{specs[0].kind}: needs the reward model's path, "
                      f"e.g. {specs[0].kind}:/models/my-rm or the embedded {specs[0].kind}:{embedded}{whole}", fix=fix)
        engine_slots = self.placement.engine_slots or self.placement.num_slots
        if self.reward_model.tp > engine_slots:
            raise bad("reward_model.tp", self.reward_model.tp, f"the reward model runs on the policy engines' "
                      f"slots, {engine_slots} here; valid: 1 to {engine_slots}", fix={"reward_model.tp": engine_slots})
        max_len = self.reward_model.max_model_len or self.engine.max_model_len
        if specs[0].kind == "judge" and self.reward_model.judge_max_tokens >= max_len:
            raise bad("reward_model.judge_max_tokens", self.reward_model.judge_max_tokens,
                      f"must be smaller than the judge's context, {max_len} tokens (reward_model.max_model_len, "
                      "else engine.max_model_len)")

    def _check_critic(self) -> None:
        algo, critic = self.algo, self.critic
        if algo.advantage == "gae" and not critic.enabled:
            raise bad("critic.model_path", "", f"algo.advantage=gae estimates each token's advantage against a value "
                      f"model, and none is given; valid: critic.model_path={POLICY} (a copy of the policy with a "
                      "scalar head) or a model's path; or a critic-free estimator (grpo, rloo, reinforce_pp)",
                      fix={"critic.model_path": POLICY})
        if critic.enabled and algo.advantage != "gae":
            raise bad("critic.model_path", critic.model_path, f"a critic trains for algo.advantage=gae alone, and "
                      f"algo.advantage={algo.advantage} takes no value; valid with it: empty (no critic)",
                      fix={"critic.model_path": ""})
        defaults = AlgoConfig()
        for key in ("gamma", "lam"):
            if algo.advantage != "gae" and getattr(algo, key) != getattr(defaults, key):
                raise bad(f"algo.{key}", getattr(algo, key), f"sets GAE (algo.advantage=gae), and algo.advantage="
                          f"{algo.advantage} does not read it; valid with it: {getattr(defaults, key)}",
                          fix={f"algo.{key}": getattr(defaults, key)})
        if critic.enabled and self.trainer.lora.rank:
            raise bad("trainer.lora.rank", self.trainer.lora.rank, f"trains adapters, and the critic "
                      f"(critic.model_path={critic.model_path}) is a full fine-tune beside the policy: a LoRA critic "
                      "is not built. Valid with a critic: 0; or a critic-free estimator (grpo, rloo, reinforce_pp)",
                      fix={"trainer.lora.rank": 0})

    def _check_algo_against_sampling(self) -> None:
        """What makes every advantage 0, so that nothing can learn: one sample per group for a group baseline, or
        greedy sampling (every sample of a group the same answer)."""
        algo, rollout = self.algo, self.rollout
        if algo.advantage in GROUP_ADVANTAGES and rollout.num_samples < 2:
            raise bad("rollout.num_samples", rollout.num_samples, f"algo.advantage={algo.advantage} takes each "
                      "sample's baseline from the other samples of its prompt: with one, every advantage is 0; "
                      "valid: >= 2, or algo.advantage=reinforce_pp (a batch baseline)", fix={"rollout.num_samples": 2})
        if algo.advantage in GROUP_ADVANTAGES and rollout.temperature < GREEDY_TEMPERATURE:
            raise bad("rollout.temperature", rollout.temperature, "greedy sampling gives every sample of a prompt "
                      f"the same answer, so algo.advantage={algo.advantage} makes every advantage 0; valid: > 0 "
                      "(e.g. 1.0)", fix={"rollout.temperature": 1.0})
        if algo.dynamic_sampling and algo.advantage not in GROUP_ADVANTAGES:
            baseline = "a learned value baseline" if algo.advantage == "gae" else "a batch baseline"
            raise bad("algo.dynamic_sampling", True, f"drops groups whose rewards are all equal, which a group "
                      f"baseline gives no gradient; algo.advantage={algo.advantage} has {baseline}, so such a "
                      "group still carries one. Valid with it: false; or a group estimator (grpo, dr_grpo, rloo)",
                      fix={"algo.dynamic_sampling": False})
        if algo.mask_truncated and rollout.ignore_eos:
            raise bad("algo.mask_truncated", True, "rollout.ignore_eos=true makes every answer run to its budget, "
                      "so every one would be left out of the loss; valid with it: false",
                      fix={"algo.mask_truncated": False})
        if rollout.update_in_pass != "never" and algo.mode != "async":
            raise bad("rollout.update_in_pass", rollout.update_in_pass, f"lets a weight update into a pass in flight, "
                      f"and only algo.mode=async updates while the engines generate (algo.mode={algo.mode}); valid "
                      "with it: never, or algo.mode=async", fix={"rollout.update_in_pass": "never"})
        if rollout.stream and rollout.leftover == "drop":
            raise bad("rollout.leftover", "drop", "drops the unfinished groups at every take, and a streamed rollout "
                      "(rollout.stream) has their answers decoding in the engines, which would run on for nothing; "
                      "valid with it: carry", fix={"rollout.leftover": "carry"})
        if rollout.stream and (algo.mode != "async" or rollout.update_in_pass == "never"):
            raise bad("rollout.stream", True, f"feeds the engines' passes without end, so it needs algo.mode=async "
                      f"with updates inside a pass (algo.mode={algo.mode}, rollout.update_in_pass="
                      f"{rollout.update_in_pass}); valid with it: algo.mode=async and rollout.update_in_pass=keep or "
                      "recompute, or rollout.stream=false", fix={"rollout.stream": False})
        if algo.mode in OVERLAPPED_MODES:
            self._check_overlapped()
        num_seqs = rollout.num_prompts * rollout.num_samples
        if num_seqs % algo.num_mini_batches:
            fits = max(n for n in range(1, algo.num_mini_batches + 1) if num_seqs % n == 0)
            raise bad("algo.num_mini_batches", algo.num_mini_batches, f"must divide the step's {num_seqs} sequences "
                      f"(rollout.num_prompts={rollout.num_prompts} x rollout.num_samples={rollout.num_samples}), "
                      f"e.g. {fits}", fix={"algo.num_mini_batches": fits})
        if algo.router_replay and (rollout.stream or rollout.speculative):
            key, value = ("rollout.stream", True) if rollout.stream else ("rollout.speculative", rollout.speculative)
            why = "reads each answer's routing when its pass ends, and a streamed answer leaves its pass before" \
                if rollout.stream else "captures the tokens of the runner's batch, and speculative decoding adds " \
                "draft tokens to it that this capture does not place"
            raise bad(key, value, f"algo.router_replay {why}; valid with router replay: "
                      + ("false" if rollout.stream else "'' (off)"), fix={key: False if rollout.stream else ""})
        if algo.overlong_buffer >= rollout.max_tokens:
            raise bad("algo.overlong_buffer", algo.overlong_buffer, f"must be smaller than rollout.max_tokens="
                      f"{rollout.max_tokens} (the punishment ramps over the last overlong_buffer tokens), or 0",
                      fix={"algo.overlong_buffer": 0})

    def _check_split(self) -> None:
        """Engines and trainers on separate slots: nothing shares a device, so nothing sleeps or moves, and the
        sync crosses devices over a process group."""
        slots, num_slots, tp = self.placement.engine_slots, self.placement.num_slots, self.engine.tp
        fix = slot_layout_fix(num_slots=num_slots, engine_slots=slots, tp=tp)
        if slots >= num_slots:
            raise bad("placement.engine_slots", slots, f"a split placement leaves at least one of "
                      f"placement.num_slots={num_slots} to the trainers; valid: 0 (co-located) or 1..{num_slots - 1} "
                      f"(a multiple of engine.tp={tp}), e.g. {overrides(fix)}", fix=fix)
        if slots % tp:
            raise bad("placement.engine_slots", slots, f"holds whole engines of engine.tp={tp} workers each; valid: "
                      f"a multiple of {tp} below placement.num_slots={num_slots}, e.g. {overrides(fix)}", fix=fix)
        if self.sync.method not in ("auto", "broadcast"):
            raise bad("sync.method", self.sync.method, "a split placement's engines share no device with a "
                      "trainer, so the sync is broadcast to them over a process group; valid with "
                      "placement.engine_slots > 0: auto, broadcast", fix={"sync.method": "auto"})
        if self.engine.sleep_level not in ("auto", "0"):
            raise bad("engine.sleep_level", self.engine.sleep_level, "a split placement's engines have their "
                      "devices to themselves, so they never sleep; valid with placement.engine_slots > 0: auto or 0",
                      fix={"engine.sleep_level": "auto"})
        if self.trainer.offload not in ("auto", "false"):
            raise bad("trainer.offload", self.trainer.offload, "a split placement's trainers have their devices "
                      "to themselves, so their state stays; valid with placement.engine_slots > 0: auto or false",
                      fix={"trainer.offload": "auto"})

    def _check_overlapped(self) -> None:
        """The engines generate while the trainer trains (one_step_off, async): nothing may sleep or move, and a
        token trained may be a version old, so the lag cap must allow one."""
        mode, rollout = self.algo.mode, self.rollout
        generates = {"one_step_off": "generates the next step's answers while this one trains",
                     "async": "generates answers without pause, while the trainer trains"}[mode]
        if self.engine.sleep_level not in ("auto", "0"):
            raise bad("engine.sleep_level", self.engine.sleep_level, f"algo.mode={mode} {generates}, so the engine "
                      "never sleeps; valid with it: auto or 0", fix={"engine.sleep_level": "auto"})
        if self.trainer.offload not in ("auto", "false"):
            raise bad("trainer.offload", self.trainer.offload, f"algo.mode={mode} trains while the engine "
                      "generates, so the trainer's state stays on the device; valid with it: auto or false",
                      fix={"trainer.offload": "auto"})
        if rollout.max_lag < 1:
            raise bad("rollout.max_lag", rollout.max_lag, f"algo.mode={mode} trains tokens sampled one policy "
                      "version before; valid with it: >= 1", fix={"rollout.max_lag": 1})
        if mode == "async":
            # rollout.stream (updates inside its passes) needs no bound: an update never waits for a pass, and new
            # prompts are fed as groups are taken (an answer spanning too many updates is restarted at its take)
            if not rollout.partial_tokens and not rollout.stream:
                quarter = -(-rollout.max_tokens // 4)  # bounds the update's wait to a quarter of an answer
                fix = {"rollout.partial_tokens": quarter,
                       **partial_rollout_fix(rollout, mode=mode, partial=quarter)}
                raise bad("rollout.partial_tokens", 0, "algo.mode=async updates the engines' weights between "
                          f"two passes, and a pass is bounded only by partial rollout; valid with it: > 0, e.g. "
                          f"{overrides(fix)} (a quarter of rollout.max_tokens, or the least with which an answer "
                          "finishes within the lag cap)", fix=fix)


def slot_layout_fix(*, num_slots: int, engine_slots: int, tp: int) -> dict[str, int]:
    """The least change to placement.engine_slots (else engine.tp) that makes the layout valid on num_slots slots
    (empty when it is): co-located, engine.tp divides num_slots; split, engine_slots is a multiple of engine.tp
    below num_slots. A smaller engine.tp is a divisor of the old one, so it still divides the model's heads."""
    if not engine_slots:
        return {} if num_slots % tp == 0 else {"engine.tp": math.gcd(num_slots, tp)}
    if num_slots < 2:  # no slot left for the trainers: co-located
        return {"placement.engine_slots": 0, **slot_layout_fix(num_slots=num_slots, engine_slots=0, tp=tp)}
    slots = min(engine_slots, num_slots - 1)
    if slots >= tp:
        slots -= slots % tp
    elif tp < num_slots:
        slots = tp
    fix = {"placement.engine_slots": slots} if slots != engine_slots else {}
    return fix if slots % tp == 0 else {**fix, "engine.tp": math.gcd(slots, tp)}


def split_choices(cfg: JobConfig) -> dict[int, JobConfig]:
    """The values placement.engine_slots=auto may take, each with the job it makes, checked as a whole (the split's
    own checks among them): with algo.mode=one_step_off or async, every multiple of engine.tp that leaves the
    trainers a slot; with algo.mode=sync, 0 alone (its phases run in turn: on a split the engines would idle while
    the trainers train, and the trainers while the engines generate). When none passes, raises the refusal of the
    largest (a key no split allows, as sync.method=gather), or one naming auto when no split can be formed."""
    tp, num_slots = cfg.engine.tp, cfg.placement.num_slots
    values = list(range(tp, num_slots, tp)) if cfg.algo.mode in OVERLAPPED_MODES else [0]
    if not values:
        # a smaller engine.tp must divide the old one, so that it still divides the model's heads
        smaller = max((t for t in range(1, tp) if tp % t == 0 and t < num_slots), default=0)
        if smaller:
            fix = {"engine.tp": smaller}
            valid = f"engine.tp={smaller} with it, placement.num_slots >= {tp + 1}, or 0 (co-located)"
        else:  # one slot: nothing to split
            fix = {"placement.engine_slots": 0, **slot_layout_fix(num_slots=num_slots, engine_slots=0, tp=tp)}
            valid = f"{overrides(fix)} (co-located), or more slots"
        raise bad("placement.engine_slots", AUTO, f"picks a split of placement.num_slots={num_slots} into whole "
                  f"engines of engine.tp={tp} workers and at least one trainer slot, and there is none; valid: "
                  f"{valid}", fix=fix)
    choices, refused = {}, None
    for slots in values:
        job = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, engine_slots=slots))
        try:
            job.check()
        except ConfigError as e:
            refused = e
            continue
        choices[slots] = job
    if not choices:
        raise refused
    return choices


# vLLM engine arguments colocate sets itself (from the key named), so a pass-through must not
_ENGINE_ARGS_OF_OURS = {
    "model": "model.path", "tensor_parallel_size": "engine.tp", "dtype": "engine.dtype",
    "max_model_len": "engine.max_model_len", "enforce_eager": "engine.enforce_eager", "seed": "engine.seed",
    "gpu_memory_utilization": "engine.gpu_memory_utilization", "enable_sleep_mode": "engine.sleep_backend",
    "max_num_seqs": "engine.max_num_seqs", "enable_prefix_caching": "engine.enable_prefix_caching",
    "enable_expert_parallel": "engine.expert_parallel", "moe_backend": None,
    "kv_cache_memory_bytes": "engine.kv_cache_gib", "worker_extension_cls": None, "skip_tokenizer_init": None,
    "distributed_executor_backend": None, "logprobs_mode": None, "enable_lora": "trainer.lora.rank",
    "max_lora_rank": "engine.max_lora_rank", "max_loras": None, "max_cpu_loras": None,
    "lora_target_modules": "trainer.lora.target_modules"}


def json_object(key: str, text: str, example: str) -> dict:
    """A str key that holds a JSON object (engine.extra_args, data.chat_template_kwargs) as a dict; empty: {}. One
    line naming the key where it is not one."""
    if not text.strip():
        return {}
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(key, text, f"not a JSON object ({e.msg}); e.g. {example}") from None
    if not isinstance(value, dict):
        raise bad(key, text, f"expected a JSON object, e.g. {example}")
    return value


def chat_template_kwargs(data: DataConfig) -> dict:
    """`data.chat_template_kwargs` as keyword arguments for the chat template."""
    return json_object("data.chat_template_kwargs", data.chat_template_kwargs, '{"enable_thinking": false}')


def engine_extra_args(engine: EngineConfig) -> dict:
    """`engine.extra_args` as keyword arguments for vLLM, checked against vLLM's own EngineArgs fields (vLLM is
    imported only when there are any)."""
    extra = json_object("engine.extra_args", engine.extra_args, '{"block_size": 32}')
    if not extra:
        return {}
    for name in extra:
        if name in _ENGINE_ARGS_OF_OURS:
            ours = _ENGINE_ARGS_OF_OURS[name]
            raise bad("engine.extra_args", name, f"colocate sets {name} itself" +
                       (f": use {ours}" if ours else " (the runtime depends on it)"))
    import difflib

    from vllm.engine.arg_utils import EngineArgs

    known = [f.name for f in dataclasses.fields(EngineArgs)]
    for name in extra:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise bad("engine.extra_args", name, "not an argument of vLLM's engine" +
                       (f"; did you mean {', '.join(close)}?" if close else ""))
    return extra
