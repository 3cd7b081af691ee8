"""Typed job configuration.

YAML files and `key=value` overrides are read with OmegaConf at the edge (`load_config`) and converted once
into these dataclasses; library code only ever sees `JobConfig`. Every field carries a one-line docstring
(the string literal under it), which `colocate config-docs` turns into the table in docs/config.md.

    >>> cfg = load_config("configs/default.yaml", ["engine.tp=1", "placement.num_slots=1"])
    >>> cfg.engine.tp
    1

Static validation (`JobConfig.validate`) checks everything that needs no machine; `preflight.check_resources`
checks what needs one (device counts). Both raise `ConfigError`, a `ValueError` whose message names the key,
the bad value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from colocate.errors import ConfigError


def _bad(key: str, value, valid: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: {valid}")


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face model directory or hub id; empty builds the embedded `preset` into `cache_dir`."""
    preset: str = "tiny"
    """Embedded model preset when `path` is empty: tiny (tests, default job), tiny-tied, bench (>= 0.4 GB bf16)."""
    cache_dir: str = "~/.cache/colocate/models"
    """Where embedded presets are built once and reused."""
    seed: int = 0
    """Seed of the embedded model's random initialisation."""


@dataclass
class TrainerConfig:
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip; 0 disables clipping."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass on each rank; gradients accumulate over micro-batches."""
    mixed_precision: bool = False
    """FSDP2 mixed precision (bf16 compute, fp32 reduce); CUDA only."""
    offload: str = "auto"
    """Move parameters and optimizer state out while the engine runs: true, false, or auto (only when the memory preflight finds the rollout would not fit beside them)."""
    offload_backend: str = "auto"
    """CUDA: torch_memory_saver (state allocated in its region, paused with a host backup), pinned (exact-size page-locked host buffers), or auto (torch_memory_saver when installed, else pinned). The CPU always uses a file-backed tier."""
    offload_dir: str = ""
    """CPU: directory of the offload file (on disk, not tmpfs); empty: the system's temporary directory."""
    num_threads: int = 1
    """Torch intra-op threads per trainer rank (CPU)."""


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
    """Skip graph capture / compilation: true (fast start), false (CUDA graphs, compiled), auto (true on the CPU, false on CUDA)."""
    max_num_seqs: int = 0
    """Most sequences the engine decodes at once; 0 keeps vLLM's default."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a shared prefix: the samples of one prompt share its prefill."""
    extra_args: str = ""
    """Other vLLM engine arguments as a JSON object, e.g. {"block_size": 32}; names are checked against vLLM's EngineArgs before anything starts."""
    sleep_level: str = "auto"
    """Engine sleep while training: 0 stays awake, 1 keeps a host copy of the weights, 2 discards them (the sync restores them), auto the least that lets the training phase fit (memory preflight)."""
    sleep_backend: str = "auto"
    """auto (vllm on CUDA, portable on CPU), vllm (vLLM sleep mode, CUDA only), portable (release storages)."""
    seed: int = 0
    """Engine sampling seed."""


@dataclass
class SyncConfig:
    bucket_mb: float = 0.0
    """Size of one bucket slot in MiB; 0 sizes it to the largest layer."""
    num_bucket_slots: int = 2
    """Bucket slots in the ring: >= 2 lets the next layer be packed while the engine loads the previous."""
    verify: str = "checksum"
    """After each sync: checksum (ring: every written range, checked before its bucket loads; in place: every engine parameter still where the trainers write), full (compare every engine tensor), or none (docs/integrity.md)."""
    transport: str = "auto"
    """gather: each layer is all-gathered over the trainers' process group and every rank hands the TP slice of the engine worker on its own device to that worker's ring (the CUDA protocol; runs on the CPU with gloo and shared memory); in_place (CPU): trainers write into the engine's parameters, kept in shared memory; ring (CPU): every rank writes its rows into every worker's ring; auto: in_place on CPU, gather on CUDA."""


@dataclass
class RolloutConfig:
    task: str = "copy"
    """Built-in toy task (copy, reverse, add) or a dotted path `module:function` returning a Task."""
    reward_fn: str = ""
    """Dotted path `module:function(prompt, response, answer) -> float`; empty uses the task's reward."""
    rewards: str = ""
    """Weighted sum of rewards, e.g. math:1.0,format:0.1: built-ins math, exact, format, char, or module:function (weight 1 when omitted); each one's mean is logged as reward_<name>_mean. Empty: rollout.reward_fn or the task's reward."""
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
    task_length: int = 3
    """Operand length (characters) of the toy tasks."""
    seed: int = 0
    """Seed of the prompt stream."""
    oversample: float = 1.0
    """Over-sampling: groups in flight per step, as a multiple of num_prompts; the rollout stops once num_prompts groups are complete (exactly that many are trained) and the rest are carried or dropped (rollout.leftover)."""
    leftover: str = "carry"
    """Groups a step does not train (unfinished, or complete beyond num_prompts): carry (they keep their tokens and go on next step) or drop."""
    partial_tokens: int = 0
    """Partial rollout: the most new tokens an answer gets in one pass (a step makes another pass only while none of its groups is complete); an answer still unfinished keeps its tokens and continues next step under the newer policy. 0: answers run to their end within the step."""
    max_lag: int = 1
    """An answer (finished or not) whose oldest token was sampled more than this many policy versions ago is restarted from its prompt; tokens within the lag are trained, corrected by the loss's ratio to their behaviour logprobs."""


@dataclass
class DataConfig:
    train_files: str = ""
    """Training prompts: comma-separated .jsonl or .parquet files (a YAML list works too; globs allowed); empty: the toy task rollout.task makes the prompts."""
    val_files: str = ""
    """Validation prompts, same format as data.train_files (read and checked; not yet evaluated during a run)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: plain text, or a list of chat messages {role, content} (rendered with the tokenizer's chat template when it has one, else their contents joined by newlines)."""
    answer_key: str = "answer"
    """Column holding the reference answer given to the reward; empty: no answers (the reward gets "")."""
    max_prompt_tokens: int = 0
    """Longest prompt in tokens; 0: whatever leaves room for one response token within engine.max_model_len."""
    too_long: str = "filter"
    """A prompt longer than the limit: filter (dropped, the count logged once) or error (the job stops naming its row)."""
    shuffle: bool = True
    """Shuffle the rows, again every epoch (with data.seed + epoch)."""
    seed: int = 0
    """Seed of the data order."""


@dataclass
class EvalConfig:
    every_steps: int = 0
    """Evaluate after every this many steps (pass@k on data.val_files, or with no data files on a fixed set of toy-task prompts); 0: never during the run."""
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
    """Sampling seed of the evaluation (the same every time, so evaluations differ only by the policy); toy tasks also draw their prompts with it."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint after every this many steps (FSDP2 shards through torch.distributed.checkpoint, the optimizer, every rank's RNG, the data position and unfinished answers); 0: only at the end (checkpoint.at_end)."""
    at_end: bool = True
    """Also save after the last step."""
    dir: str = ""
    """Where checkpoints go (one step_<N> folder each); empty: <logging.output_dir>/checkpoints. Several nodes: a directory every node sees."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete. 0 keeps all."""
    resume: str = ""
    """auto: continue from the newest complete checkpoint in checkpoint.dir (start afresh when there is none); a step_<N> path: continue from it; empty: start afresh. Also given as resume=... on the command line."""
    export_hf: bool = False
    """Also write a Hugging Face model (safetensors, config, tokenizer) into each checkpoint's hf/ folder."""


@dataclass
class FaultConfig:
    heartbeat_s: float = 1.0
    """How often the controller checks that every process of the job on its node is alive and running (a dead, zombie or stopped one ends the job at once, named)."""
    sync_timeout_s: float = 600.0
    """A weight sync or a sleep/wake switch that has not finished after this many seconds is a hang: the job stops naming its members. 0: no limit."""
    checkpoint_timeout_s: float = 1800.0
    """The same bound for a checkpoint save (and its HF export). A save writes about 12 bytes per parameter (fp32 weights and AdamW's two moments: 91 GB for a 7B model): size it as 2 x those bytes / the storage's slowest write rate (docs/checkpoints.md). 0: no limit."""
    rollout_timeout_s: float = 0.0
    """The same bound for a rollout phase; 0: no limit (a rollout's length is the model's to decide)."""
    train_timeout_s: float = 0.0
    """The same bound for a training phase; 0: no limit."""
    inject: str = ""
    """Chaos testing: SIGNAL:MEMBER:PHASE:STEP sends a signal to one process of the job as that phase of that step begins, e.g. SIGKILL:engine0.worker1:rollout:2, SIGKILL:trainer1:train:1, SIGSTOP:engine0.worker0:sync:1 (members: trainerR, engineE, engineE.workerK); empty: none."""
    max_restarts: int = 0
    """After a fault (a member died or hung), start the job again from its newest checkpoint (resume=auto) up to this many times; 0: stop with the fault."""


@dataclass
class AlgoConfig:
    num_steps: int = 150
    """RL steps to run."""
    clip_eps: float = 0.2
    """PPO/GRPO ratio clip."""
    normalize_advantages: bool = True
    """Divide group-relative advantages by the group's standard deviation."""
    correction: str = "none"
    """Training/inference mismatch correction: none (PPO ratio against the engine's logprobs), tis (truncated importance weights), mis (masked importance weights)."""
    correction_level: str = "token"
    """Importance weight per token, or per sequence (the product over its tokens)."""
    tis_cap: float = 2.0
    """TIS: importance weights are truncated at this value."""
    mis_low: float = 0.5
    """MIS: weights below this are masked (the token or sequence is dropped)."""
    mis_high: float = 2.0
    """MIS: weights above this are masked."""
    mismatch_band: float = 1.1
    """Monitor: report the fraction of tokens and sequences whose ratio p_trainer / p_engine lies outside [1/band, band]."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy (the initial weights); 0: no reference, no KL."""
    kl_estimator: str = "k3"
    """KL estimator per token, log r = logp_ref - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""


@dataclass
class PlacementConfig:
    device: str = "auto"
    """auto, cpu or cuda."""
    num_slots: int = 2
    """Device slots (GPUs, or logical CPU slots); each holds one trainer rank and one engine worker."""
    ray_address: str = ""
    """Existing Ray cluster to join ('auto', or host:port); empty starts a local Ray."""


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


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def num_engines(self) -> int:
        return self.placement.num_slots // self.engine.tp

    def validate(self) -> None:
        """Checks that need no machine. Raises ConfigError naming the first bad key."""
        from colocate.models import sources as models  # local: models imports this module

        _positive(self, "trainer.lr", "trainer.micro_batch_size", "trainer.num_threads", "engine.tp",
                  "engine.max_model_len", "sync.num_bucket_slots", "rollout.num_prompts", "rollout.num_samples",
                  "rollout.max_tokens", "rollout.task_length", "rollout.top_p", "algo.num_steps",
                  "placement.num_slots")
        _non_negative(self, "trainer.weight_decay", "trainer.grad_clip", "rollout.temperature", "sync.bucket_mb",
                      "algo.clip_eps")
        _one_of(self, "engine.dtype", ["bfloat16", "float16", "float32"])
        _one_of(self, "engine.sleep_level", ["auto", "0", "1", "2"])
        _one_of(self, "trainer.offload", ["auto", "true", "false"])
        _one_of(self, "trainer.offload_backend", ["auto", "pinned", "torch_memory_saver"])
        _one_of(self, "engine.sleep_backend", ["auto", "vllm", "portable"])
        _one_of(self, "engine.enforce_eager", ["auto", "true", "false"])
        _non_negative(self, "engine.max_num_seqs")
        engine_extra_args(self.engine)
        _one_of(self, "sync.verify", ["checksum", "full", "none"])
        _one_of(self, "sync.transport", ["auto", "gather", "in_place", "ring"])
        _one_of(self, "algo.correction", ["none", "tis", "mis"])
        _one_of(self, "algo.correction_level", ["token", "sequence"])
        if self.algo.tis_cap < 1:
            raise _bad("algo.tis_cap", self.algo.tis_cap, "must be >= 1 (weights are truncated at it)")
        if not 0 <= self.algo.mis_low <= 1 <= self.algo.mis_high:
            raise _bad("algo.mis_low", f"{self.algo.mis_low}..{self.algo.mis_high}",
                       "need 0 <= algo.mis_low <= 1 <= algo.mis_high (the band must hold the ratio 1)")
        if self.algo.mismatch_band <= 1:
            raise _bad("algo.mismatch_band", self.algo.mismatch_band, "must be > 1 (the band is [1/band, band])")
        _non_negative(self, "algo.kl_coef")
        _one_of(self, "algo.kl_estimator", ["k1", "k2", "k3"])
        _one_of(self, "placement.device", ["auto", "cpu", "cuda"])
        _one_of(self, "logging.level", ["DEBUG", "INFO", "WARNING", "ERROR"])
        _one_of(self, "logging.wandb_mode", ["offline", "online"])
        if self.logging.wandb and not self.logging.wandb_project:
            raise _bad("logging.wandb_project", "", "must name a project when logging.wandb=true")
        if not self.model.path:
            _one_of(self, "model.preset", sorted(models.PRESETS))
        if self.rollout.oversample < 1:
            raise _bad("rollout.oversample", self.rollout.oversample,
                       "must be >= 1 (a multiple of rollout.num_prompts groups in flight)")
        _one_of(self, "rollout.leftover", ["carry", "drop"])
        _non_negative(self, "rollout.partial_tokens", "rollout.max_lag")
        if self.rollout.partial_tokens and self.rollout.leftover == "drop":
            raise _bad("rollout.leftover", "drop", "partial rollout (rollout.partial_tokens > 0) carries unfinished "
                       "answers over; valid with it: carry")
        partial, lag = self.rollout.partial_tokens, self.rollout.max_lag
        if partial and self.rollout.max_tokens > (lag + 1) * partial:
            raise _bad("rollout.partial_tokens", partial,
                       f"an answer of rollout.max_tokens={self.rollout.max_tokens} needs more than rollout.max_lag + 1 = "
                       f"{lag + 1} passes and would be restarted forever; valid: partial_tokens >= "
                       f"{-(-self.rollout.max_tokens // (lag + 1))}, or a larger rollout.max_lag")
        if self.rollout.top_p > 1:
            raise _bad("rollout.top_p", self.rollout.top_p, "must be in (0, 1]")
        if self.sync.num_bucket_slots < 2:
            raise _bad("sync.num_bucket_slots", self.sync.num_bucket_slots,
                       "must be >= 2 (one slot is packed while the engine loads the other)")
        if self.placement.num_slots % self.engine.tp:
            raise _bad("engine.tp", self.engine.tp,
                       f"must divide placement.num_slots={self.placement.num_slots}")
        if not 0 < self.engine.gpu_memory_utilization <= 1:
            raise _bad("engine.gpu_memory_utilization", self.engine.gpu_memory_utilization, "must be in (0, 1]")
        if self.engine.kv_cache_gib <= 0:
            raise _bad("engine.kv_cache_gib", self.engine.kv_cache_gib, "must be > 0")
        if self.rollout.max_tokens >= self.engine.max_model_len:
            raise _bad("rollout.max_tokens", self.rollout.max_tokens,
                       f"must be smaller than engine.max_model_len={self.engine.max_model_len}")
        from colocate.rl.tasks import load_reward_fn, make_task

        make_task(self.rollout.task, length=self.rollout.task_length)
        if self.rollout.reward_fn:
            load_reward_fn(self.rollout.reward_fn)
        if self.rollout.rewards:
            from colocate.rl.rewards import parse_rewards

            if self.rollout.reward_fn:
                raise _bad("rollout.rewards", self.rollout.rewards, "rollout.reward_fn is set too; give one of them "
                           "(a module:function can be a component of rollout.rewards)")
            parse_rewards(self.rollout.rewards)
        self._validate_data()
        _non_negative(self, "checkpoint.every_steps", "checkpoint.keep_last")
        _positive(self, "fault.heartbeat_s")
        if self.fault.inject:
            from colocate.job.faults import parse_injection

            parse_injection(self.fault.inject)
        _non_negative(self, "fault.sync_timeout_s", "fault.checkpoint_timeout_s", "fault.rollout_timeout_s",
                      "fault.train_timeout_s", "fault.max_restarts")
        _non_negative(self, "eval.every_steps", "eval.temperature", "eval.max_tokens", "eval.max_prompts")
        _positive(self, "eval.num_samples")
        if self.eval.temperature == 0 and self.eval.num_samples > 1:
            raise _bad("eval.num_samples", self.eval.num_samples, "greedy decoding (eval.temperature=0) gives one "
                       "answer per prompt; valid: 1, or set eval.temperature > 0 for pass@k")
        if self.eval.max_tokens >= self.engine.max_model_len:
            raise _bad("eval.max_tokens", self.eval.max_tokens,
                       f"must be smaller than engine.max_model_len={self.engine.max_model_len}")
        if (self.eval.every_steps or self.eval.at_start or self.eval.at_end) and self.data.train_files \
                and not self.data.val_files:
            raise _bad("data.val_files", "", "evaluation (eval.every_steps, eval.at_start, eval.at_end) of a run on "
                       "data.train_files needs validation prompts; give data.val_files or turn evaluation off")
        if self.sync.bucket_mb > 0:
            largest = largest_tensor_bytes(self)
            if largest is not None and self.sync.bucket_mb * (1 << 20) < largest:
                raise _bad("sync.bucket_mb", self.sync.bucket_mb,
                           f"must hold the largest tensor ({largest / (1 << 20):.2f} MiB in {self.engine.dtype}), "
                           "or 0 to size it automatically")
        if self.model.path and Path(self.model.path).expanduser().is_dir() \
                and not (Path(self.model.path).expanduser() / "config.json").is_file():
            raise _bad("model.path", self.model.path, "the directory has no config.json (not a Hugging Face model "
                       "directory)")
        if self.model.path and "/" in self.model.path and not Path(self.model.path).exists() \
                and (self.model.path.startswith((".", "/", "~")) or self.model.path.count("/") != 1):
            # "org/name" may be a hub id; anything path-like must exist.
            raise _bad("model.path", self.model.path, "no such directory (give a Hugging Face model directory "
                       "or hub id, or leave empty for the embedded preset)")


    def _validate_data(self) -> None:
        """The data keys and that every file exists with a supported extension; reading the rows (keys, empty
        prompts, lengths) needs the tokenizer and is `data.make_prompt_source`'s, still before any actor starts."""
        from colocate.rl.data import data_files

        _one_of(self, "data.too_long", ["filter", "error"])
        _non_negative(self, "data.max_prompt_tokens")
        if self.data.max_prompt_tokens >= self.engine.max_model_len:
            raise _bad("data.max_prompt_tokens", self.data.max_prompt_tokens,
                       f"must be smaller than engine.max_model_len={self.engine.max_model_len} (room to answer)")
        if (self.data.train_files or self.data.val_files) and not self.data.prompt_key:
            raise _bad("data.prompt_key", "", "name the column holding the prompts, e.g. prompt")
        data_files(self.data.train_files, "data.train_files")
        data_files(self.data.val_files, "data.val_files")


# vLLM engine arguments colocate sets itself (from the key named), so a pass-through must not
_ENGINE_ARGS_OF_OURS = {
    "model": "model.path", "tensor_parallel_size": "engine.tp", "dtype": "engine.dtype",
    "max_model_len": "engine.max_model_len", "enforce_eager": "engine.enforce_eager", "seed": "engine.seed",
    "gpu_memory_utilization": "engine.gpu_memory_utilization", "enable_sleep_mode": "engine.sleep_backend",
    "max_num_seqs": "engine.max_num_seqs", "enable_prefix_caching": "engine.enable_prefix_caching",
    "kv_cache_memory_bytes": "engine.kv_cache_gib", "worker_extension_cls": None, "skip_tokenizer_init": None,
    "distributed_executor_backend": None, "logprobs_mode": None}


def engine_extra_args(engine: EngineConfig) -> dict:
    """`engine.extra_args` as keyword arguments for vLLM, checked against vLLM's own EngineArgs fields (vLLM is
    imported only when there are any)."""
    if not engine.extra_args.strip():
        return {}
    import json

    try:
        extra = json.loads(engine.extra_args)
    except json.JSONDecodeError as e:
        raise _bad("engine.extra_args", engine.extra_args, f"not a JSON object ({e.msg}); e.g. "
                   '{"block_size": 32}') from None
    if not isinstance(extra, dict):
        raise _bad("engine.extra_args", engine.extra_args, 'expected a JSON object, e.g. {"block_size": 32}')
    for name in extra:
        if name in _ENGINE_ARGS_OF_OURS:
            ours = _ENGINE_ARGS_OF_OURS[name]
            raise _bad("engine.extra_args", name, f"colocate sets {name} itself" +
                       (f": use {ours}" if ours else " (the runtime depends on it)"))
    import difflib

    from vllm.engine.arg_utils import EngineArgs

    known = [f.name for f in dataclasses.fields(EngineArgs)]
    for name in extra:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise _bad("engine.extra_args", name, "not an argument of vLLM's engine" +
                       (f"; did you mean {', '.join(close)}?" if close else ""))
    return extra


def largest_tensor_bytes(cfg: JobConfig) -> int | None:
    """Bytes of the model's largest weight in the engine dtype, from the preset or the model's config.json
    (None when the model is a hub id not on this machine)."""
    import json

    from colocate.models import sources as models

    if not cfg.model.path:
        p = models.PRESETS[cfg.model.preset]
        dims = dict(vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size)
    else:
        config_file = Path(cfg.model.path).expanduser() / "config.json"
        if not config_file.is_file():
            return None
        dims = json.loads(config_file.read_text())
        dims = dims.get("text_config", dims)
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.engine.dtype]
    hidden = dims["hidden_size"]
    return max(dims["vocab_size"], dims.get("intermediate_size", hidden), hidden) * hidden * itemsize


def _get(cfg: JobConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _positive(cfg: JobConfig, *keys: str) -> None:
    for key in keys:
        if not _get(cfg, key) > 0:
            raise _bad(key, _get(cfg, key), "must be > 0")


def _non_negative(cfg: JobConfig, *keys: str) -> None:
    for key in keys:
        if _get(cfg, key) < 0:
            raise _bad(key, _get(cfg, key), "must be >= 0")


def _one_of(cfg: JobConfig, key: str, valid: list) -> None:
    if _get(cfg, key) not in valid:
        raise _bad(key, _get(cfg, key), "valid: " + ", ".join(map(str, valid)))


# ---------------------------------------------------------------------------------------------------------------
# The edge: YAML + key=value overrides -> JobConfig, once.


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Merge the YAML file (if any) and `key=value` overrides onto the defaults and validate statically."""
    from omegaconf import OmegaConf

    merged = OmegaConf.create({})
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            merged = OmegaConf.load(path)
        except Exception as e:  # yaml.YAMLError and OmegaConf's own errors
            raise ConfigError(f"config file {path!r} is not valid YAML: {_first_line(e)}") from None
        if not isinstance(merged, typing.Mapping):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections (model:, engine:, ...)")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is invalid: expected key=value, e.g. engine.tp=2")
        key, _, raw = item.partition("=")
        key = _ALIASES.get(key, key)
        try:  # the value is read as YAML (numbers, booleans, mappings)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={raw}"]))
        except Exception as e:  # yaml's and OmegaConf's parse errors: one line naming the override
            raise ConfigError(f"override {item!r} is invalid: its value is not valid YAML "
                              f"({_first_line(e)}); quote it, e.g. {key}='...'") from None
    cfg = from_dict(OmegaConf.to_container(merged, resolve=True) or {})
    cfg.validate()
    return cfg


def from_dict(data: dict) -> JobConfig:
    """Build a JobConfig from plain nested dicts, rejecting unknown keys and values of the wrong type."""
    return _build(JobConfig, data, prefix="")


def _build(cls, data, *, prefix: str):
    if not isinstance(data, dict):
        raise _bad(prefix.rstrip(".") or "config", data, "expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown key {key!r}; valid keys here: {', '.join(fields)}")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


# short forms accepted on the command line: `colocate launch ... resume=auto`
_ALIASES = {"resume": "checkpoint.resume"}
# str keys that hold JSON: a YAML mapping given for them (engine.extra_args: {block_size: 32}) is kept as JSON text
_JSON_KEYS = {"engine.extra_args"}
# str keys that hold a comma-separated list: a YAML list given for them is joined with commas
_LIST_KEYS = {"data.train_files", "data.val_files"}


def _coerce(key: str, value, hint):
    if key in _JSON_KEYS and isinstance(value, (dict, list)):
        import json

        return json.dumps(value)
    if key in _LIST_KEYS and isinstance(value, list):
        if not all(isinstance(v, str) and "," not in v for v in value):
            raise _bad(key, value, "expected a list of file paths (without commas)")
        return ",".join(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _bad(key, value, "expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _bad(key, value, "expected an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _bad(key, value, "expected a number")
    if hint is str:
        if value is None:
            return ""
        if isinstance(value, bool):  # keys that take true/false/auto (YAML reads true as a bool)
            return str(value).lower()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _bad(key, value, "expected a string")
    raise AssertionError(f"unsupported config type {hint} for {key}")


def to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


# ---------------------------------------------------------------------------------------------------------------
# Documentation generated from the dataclasses, so docs/config.md cannot drift from the code.


def field_docs() -> list[tuple[str, str, object, str]]:
    """(key, type, default, doc) for every config key, docs taken from the string under each field."""
    import ast
    import inspect

    rows = []
    for section in dataclasses.fields(JobConfig):
        cls = typing.get_type_hints(JobConfig)[section.name]
        tree = ast.parse(inspect.getsource(cls))
        docs, last = {}, None
        for node in tree.body[0].body:
            if isinstance(node, ast.AnnAssign):
                last = node.target.id
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and last:
                docs[last] = node.value.value
                last = None
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            rows.append((f"{section.name}.{f.name}", hints[f.name].__name__, f.default, docs.get(f.name, "")))
    return rows


def config_docs_markdown() -> str:
    lines = ["# Configuration keys", "",
             "Generated by `colocate config-docs` from `colocate/config.py`; a test keeps it in step.", "",
             "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, type_name, default, doc in field_docs():
        lines.append(f"| `{key}` | {type_name} | `{default!r}` | {doc} |")
    return "\n".join(lines) + "\n"
