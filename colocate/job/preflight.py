"""Memory preflight: predict each phase's peak from the config and the model, before any actor starts, and
decide what must move between phases (the switch plan).

Co-located RL's most common failure is an out-of-memory crash mid-run (at wake, when old weights, new weights
and the KV cache coexist). The preflight adds up what each phase keeps resident and stops the job with one line
naming the phase, the shortfall and what to change, instead of letting it crash minutes in.

    result = preflight(cfg, device="cuda", available_bytes=80 * GIB)   # ConfigError if a phase cannot fit
    result.plan.engine_sleep_level, result.plan.trainer_offload    # what the controller must move
    result.phases                                                  # startup, rollout, train, sync, with parts

On the CPU every part lives in host memory, so a phase's total is summed over all processes of the job (the
trainer ranks, the engine workers, Ray). On CUDA the budget is one GPU, and a slot is one GPU holding one
trainer rank and one engine TP worker: every part is per GPU. docs/preflight.md explains each part.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from colocate.config import JobConfig
from colocate.config.reward_model import reward_models_in
from colocate.errors import ConfigError
from colocate.host.node_checks import host_needs
from colocate.job.placement import sync_in_place, sync_transport
from colocate.models.sources import is_hub_id
from colocate.trainer.batching import attention_implementation
from colocate.trainer.step_memory import kept_group_params, micro_batch_parts, unsharded_group_bytes

GIB = 1 << 30
MIB = 1 << 20
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Memory of each process before it holds model state (interpreter, torch, vLLM or transformers imports, Ray's
# core worker): proportional set sizes (each shared page counted once over the job, as the machine's memory
# counts it), measured per process kind during the default job on the CPU machines of DESIGN.md with
# `colocate bench switch configs/default.yaml` (its JSON keeps the per-process readings under "preflight").
TRAINER_PROCESS_BYTES = int(0.31 * GIB)
ENGINE_WORKER_PROCESS_BYTES = int(0.48 * GIB)
ENGINE_ACTOR_PROCESS_BYTES = int(0.44 * GIB)  # runs vLLM's engine core in-process
RAY_DAEMONS_BYTES = int(0.50 * GIB)  # gcs, raylet, dashboard and its agents, log monitor
DRIVER_PROCESS_BYTES = int(0.32 * GIB)  # the `colocate launch` process
PROMPT_TOKENS = 64
HEADROOM = 0.10  # leave this fraction of the available memory to the OS and page cache

# CUDA: estimates, not yet measured on a GPU of ours; scripts/gpu_check.py's "constants" section measures those
# one GPU can show (docs/preflight.md lists them).
CUDA_CONTEXT_BYTES = int(0.5 * GIB)  # per process (trainer rank, engine worker): context, kernels, cuBLAS
# An NCCL communicator's buffers and its share of the context (reported 0.5-1.5 GiB per process): the trainer's
# FSDP2 group (world > 1) and an engine worker's TP group (tp > 1). vLLM creates its TP group *before* the
# snapshot its memory budget starts from (vllm/v1/worker/gpu_worker.py, init_device: "Initialize the distributed
# environment BEFORE taking memory snapshot"), so it lies outside gpu_memory_utilization, as the context does.
NCCL_COMMUNICATOR_BYTES = int(1.0 * GIB)
# What an engine keeps outside vLLM's cuMem sleep pool while asleep: torch's cache, the sampler's buffers
ENGINE_ASLEEP_BYTES = int(0.5 * GIB)
# CUDA graphs' memory pool: inside the budget while awake (vLLM 0.32 subtracts its estimate from the KV cache,
# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default), but resident while asleep
# (ModelConfig.sleep_mode_offload_cudagraph=False by default, vllm/config/model.py)
CUDA_GRAPH_POOL_BYTES = int(1.0 * GIB)
GPU_HEADROOM = 0.03  # fragmentation of two caching allocators


@dataclass
class ModelDims:
    num_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_params: int  # one decoder layer
    tie_word_embeddings: bool
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0  # routed experts per layer; 0: dense
    shared_expert_size: int = 0  # a MoE layer's shared expert's intermediate size; 0: none

    @classmethod
    def from_config_dict(cls, d: dict) -> ModelDims:
        d = d.get("text_config", d)
        hidden, layers = d["hidden_size"], d["num_hidden_layers"]
        inter = d.get("intermediate_size", 4 * hidden)
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or hidden // heads
        kv = d.get("num_key_value_heads", heads)
        # q/k/v biases: Qwen2's always (its config has no key for them), others' where attention_bias says so;
        # Qwen3's per-head q and k norms instead
        model_type = d.get("model_type", "")
        qkv_bias = d.get("attention_bias", model_type.startswith("qwen2"))
        attention = hidden * head_dim * (2 * heads + 2 * kv) + (head_dim * (heads + 2 * kv) if qkv_bias else 0) \
            + (2 * head_dim if model_type.startswith("qwen3") else 0)
        num_experts = num_routed_experts(d)
        if num_experts:  # every layer sparse (Qwen3-MoE, Mixtral): experts, router, an optional shared expert
            expert_inter = d.get("moe_intermediate_size") or inter
            shared = d.get("shared_expert_intermediate_size") or 0
            mlp = num_experts * (3 * hidden * expert_inter + hidden) + 3 * hidden * shared + (hidden if shared else 0)
            inter = d.get("num_experts_per_tok", 1) * expert_inter + shared  # what one token computes through
        else:
            mlp = 3 * hidden * inter
        per_layer = attention + mlp + 2 * hidden
        tied = bool(d.get("tie_word_embeddings"))
        embeddings = d["vocab_size"] * hidden * (1 if tied else 2)
        return cls(layers * per_layer + embeddings + hidden, layers, hidden, d["vocab_size"], per_layer, tied,
                   inter, heads, kv, head_dim, num_experts, shared if num_experts else 0)

    def projections(self) -> dict[str, tuple[int, int]]:
        """The linear projections of a decoder layer, name -> (in, out) features: attention's, and the MLP's
        where it is made of linear layers (a dense model's; a MoE layer's shared expert: routed experts are
        fused tensors)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = {"q_proj": (self.hidden_size, q_out), "k_proj": (self.hidden_size, kv_out),
               "v_proj": (self.hidden_size, kv_out), "o_proj": (q_out, self.hidden_size)}
        mlp = self.shared_expert_size if self.num_experts else self.intermediate_size
        if mlp:
            out.update(gate_proj=(self.hidden_size, mlp), up_proj=(self.hidden_size, mlp),
                       down_proj=(mlp, self.hidden_size))
        return out

    @property
    def root_params(self) -> int:
        """FSDP2's root group: what is not in a decoder layer (embeddings, final norm, lm_head)."""
        return self.num_params - self.num_layers * self.layer_params

    @property
    def largest_sync_group(self) -> int:
        """The sync streams pre (embeddings), each layer, post (final norm + lm_head): the largest, in params."""
        embedding = self.vocab_size * self.hidden_size
        return max(embedding, self.layer_params, self.hidden_size + (0 if self.tie_word_embeddings else embedding))


def num_adapter_params(cfg: JobConfig, dims: ModelDims) -> int:
    """A LoRA job's adapter parameters (trainer.lora): rank x (in + out) per adapted projection and layer."""
    lora = cfg.trainer.lora
    if not lora.rank:
        return 0
    shapes = dims.projections()
    targets = set(shapes) if "all-linear" in lora.targets else set(lora.targets) & set(shapes)
    return dims.num_layers * lora.rank * sum(sum(shapes[t]) for t in targets)


def trainer_state_bytes(cfg: JobConfig, dims: ModelDims) -> tuple[int, int]:
    """(params + optimizer, params + grads + optimizer) of the whole model in bytes, fp32: each trained
    parameter has a gradient and two AdamW moments the size of itself. A LoRA job trains its adapters alone: the
    frozen base has no gradient and no optimizer state."""
    trained = num_adapter_params(cfg, dims) if cfg.trainer.lora.rank else dims.num_params
    params = 4 * (dims.num_params + (trained if cfg.trainer.lora.rank else 0))
    return params + 8 * trained, params + 12 * trained


def num_routed_experts(config: dict) -> int:
    """A model config's routed experts per layer, under the names the MoE families use (Qwen2/3-MoE, transformers
    5's saved configs, Mixtral, DeepSeek); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


@dataclass
class Phase:
    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class SwitchPlan:
    engine_sleep_level: int  # 0 (engine stays awake while training), 1 or 2
    trainer_offload: bool  # trainer state leaves the device while the engine runs
    reason: str  # one line, printed at start


@dataclass(frozen=True)
class Prediction:
    plan: SwitchPlan
    phases: list[Phase]  # under `plan`; empty when the model's dims are unknown (a hub id)
    device: str
    available_bytes: int  # CPU: the host's available memory; CUDA: one GPU's total memory
    budget_bytes: int  # what a phase may use: available_bytes less the headroom
    host_needs: dict[str, int] = field(default_factory=dict)
    """CUDA: what the node's host memory must hold (node_checks.host_needs); empty on the CPU or without dims."""


def model_dims(cfg: JobConfig) -> ModelDims | None:
    """From the preset, or the model's config.json on this machine (None for a hub id not on this machine)."""
    from colocate.models import sources as models

    if not cfg.model.path:
        p = models.PRESETS[cfg.model.preset]
        return ModelDims.from_config_dict({**asdict(p), "num_hidden_layers": p.num_layers,
                                           "model_type": "qwen3_moe" if p.num_experts else "qwen2"})
    config_file = model_config_file(cfg.model.path)
    if config_file is None:
        return None
    return ModelDims.from_config_dict(json.loads(config_file.read_text()))


def model_config_file(path: str) -> Path | None:
    """`path`'s config.json: in the directory `path`, or for a hub id ("org/name") in the Hugging Face cache,
    where a download put it (a run's, or `hf download ORG/NAME config.json`). Never asks the network; None when
    neither has it."""
    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return local / "config.json"
    if local.exists() or not is_hub_id(path):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json")
    except (ImportError, ValueError, OSError):  # no huggingface_hub, not a valid repo id: as if not downloaded
        return None
    return Path(found) if isinstance(found, str) else None


def predict_phases(cfg: JobConfig, dims: ModelDims, *, device: str, plan: SwitchPlan | None = None,
                   gpu_bytes: int | None = None) -> list[Phase]:
    """Each phase's resident parts under `plan` (default: the config's explicit choices, everything moving where
    'auto'). CUDA: per GPU of `gpu_bytes` (default: this machine's first GPU)."""
    plan = plan or default_plan(cfg)
    if device == "cuda":
        return _cuda_phases(cfg, dims, plan, gpu_bytes if gpu_bytes is not None else gpu_total_bytes())
    return _cpu_phases(cfg, dims, plan)


def train_micro_batch_shape(cfg: JobConfig, device: str = "cpu") -> tuple[int, int, bool]:
    """(rows, tokens per row, attention mask materialised) of the largest micro-batch the trainer runs
    (trainer/batching.py). A sequence is bounded by rollout.max_tokens of answer; its prompt is not known before
    the task runs, so PROMPT_TOKENS is a generous guess (data.max_prompt_tokens when set), both capped by the
    engine's context. With a token budget the micro-batch holds at most the budget's tokens."""
    trainer = cfg.trainer
    prompt = cfg.data.max_prompt_tokens or PROMPT_TOKENS
    longest = min(cfg.engine.max_model_len, prompt + cfg.rollout.max_tokens)
    tokens = trainer.micro_batch_size * longest
    if trainer.max_tokens_per_micro_batch is not None:
        tokens = min(tokens, trainer.max_tokens_per_micro_batch) if not trainer.pack_sequences \
            else trainer.max_tokens_per_micro_batch
    if trainer.pack_sequences:
        return 1, tokens, attention_implementation(trainer, device) != "flash_attention_2"
    rows = max(1, tokens // longest)
    return rows, longest, rows > 1


def micro_batch_bytes(cfg: JobConfig, dims: ModelDims, device: str = "cpu",
                      shape: tuple[int, int, bool] | None = None) -> dict[str, int]:
    """One rank's activations, log-prob pass and FSDP2 unsharded groups while it trains (trainer/step_memory.py),
    for a micro-batch of `shape` (rows, tokens per row, mask materialised; default: the largest the config
    allows, train_micro_batch_shape)."""
    compute = 2 if cfg.trainer.mixed_precision else 4
    rows, length, masked = shape or train_micro_batch_shape(cfg, device)
    return {**micro_batch_parts(dims, num_tokens=rows * length, micro_batch_size=rows, compute_bytes=compute,
                                temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                                checkpointed=cfg.trainer.activation_checkpointing, masked=masked),
            "fsdp unsharded groups": unsharded_group_bytes(dims, compute_bytes=compute)}


def _cpu_phases(cfg: JobConfig, dims: ModelDims, plan: SwitchPlan) -> list[Phase]:
    world, tp, engines = cfg.placement.num_trainer_ranks, cfg.engine.tp, cfg.num_engines
    params = dims.num_params * 4  # fp32 master weights
    kept, training_state = trainer_state_bytes(cfg, dims)
    engine_weights = engines * dims.num_params * DTYPE_BYTES[cfg.engine.dtype]
    training = {part: world * num_bytes for part, num_bytes in micro_batch_bytes(cfg, dims).items()}
    layer_bytes = engine_weights // engines // max(dims.num_layers, 1)
    ring = engines * cfg.sync.num_bucket_slots * max(int(cfg.sync.bucket_mb * MIB), layer_bytes)
    if sync_in_place(cfg, "cpu"):
        ring = 0  # the trainers write into the engine's own parameters
    kv = engines * tp * int(cfg.engine.kv_cache_gib * GIB)
    base = {"processes": world * TRAINER_PROCESS_BYTES + engines * (tp * ENGINE_WORKER_PROCESS_BYTES
                                                                    + ENGINE_ACTOR_PROCESS_BYTES)
            + RAY_DAEMONS_BYTES + DRIVER_PROCESS_BYTES}
    awake = plan.engine_sleep_level == 0
    base.update(_cpu_reward_model(cfg))
    engine_in_train = {"engine awake (weights + kv cache)": engine_weights + kv} if awake else \
        {"engine host copy (sleep level 1)": engine_weights if plan.engine_sleep_level == 1 else 0}
    return [
        # every rank loads the full checkpoint before it shards it
        Phase("startup", {**base, "checkpoint loaded on every rank": world * params}),
        # offloaded, the trainer's state waits in a file (page cache the kernel may reclaim), not in a process
        Phase("rollout", {**base, "trainer params + optimizer": 0 if plan.trainer_offload else kept,
                          "engine weights": engine_weights, "kv cache": kv, "sync ring": ring}),
        Phase("train", {**base, "trainer params + grads + optimizer": training_state, **training,
                        "sync ring": ring, **engine_in_train}),
        Phase("sync", {**base, "trainer params + optimizer": kept, "engine weights": engine_weights,
                       "engine kv cache (awake)": kv if awake else 0, "sync ring": ring}),
    ]


def _cpu_reward_model(cfg: JobConfig) -> dict[str, int]:
    """rollout.rewards=model:PATH or judge:PATH on the CPU: its engine's processes and KV cache, in every phase
    (asleep at level 1 on the CPU, its weights' host copy sits in the same memory). Its weights are not counted:
    its dimensions are read once it is fetched, after this check; the embedded tiny-rm's are a few MiB."""
    if not reward_models_in(cfg.rollout.rewards):
        return {}
    tp = cfg.reward_model.tp
    return {"reward model (processes + kv cache)": ENGINE_ACTOR_PROCESS_BYTES + tp * ENGINE_WORKER_PROCESS_BYTES
            + tp * int(cfg.reward_model.kv_cache_gib * GIB)}


def _cuda_reward_model(cfg: JobConfig, gpu_bytes: int, *, asleep: bool) -> dict[str, int]:
    """The reward model's part of one of its GPUs (the first reward_model.tp slots of the policy's engines): its
    budget while awake, a context and vLLM's residue while it sleeps with the policy's engines (level 1)."""
    if not reward_models_in(cfg.rollout.rewards):
        return {}
    if asleep:
        return {"reward model asleep (context + residue, est.)": CUDA_CONTEXT_BYTES + ENGINE_ASLEEP_BYTES}
    return {"reward model (context, est.)": CUDA_CONTEXT_BYTES,
            "reward model (reward_model.gpu_memory_utilization)": int(cfg.reward_model.gpu_memory_utilization
                                                                       * gpu_bytes)}


def _split_cuda_phases(cfg: JobConfig, dims: ModelDims) -> list[Phase]:
    """A trainer rank's GPU in a split placement: its shard, its training, the gather and the broadcast staging.
    The engines' GPUs are not predicted here: vLLM checks its own against engine.gpu_memory_utilization as it
    starts, and what it does not count (each worker's ring, num_bucket_slots x the slot, and its broadcast
    communicator) must fit in the rest of the GPU."""
    world, tp = cfg.placement.num_trainer_ranks, cfg.engine.tp
    engine_dtype = DTYPE_BYTES[cfg.engine.dtype]
    shard = 4 * dims.num_params // world
    kept, training_state = (num_bytes // world for num_bytes in trainer_state_bytes(cfg, dims))
    fed = -(-tp // world)  # the TP ranks the busiest rank feeds: a broadcast group and a staging ring each
    num_communicators = (world > 1) + fed
    contexts = {"cuda context (est.)": CUDA_CONTEXT_BYTES,
                f"nccl communicators ({num_communicators}: fsdp2, broadcast; est.)":
                    num_communicators * NCCL_COMMUNICATOR_BYTES}
    slot = int(cfg.sync.bucket_mb * MIB) if cfg.sync.bucket_mb > 0 else dims.largest_sync_group * engine_dtype // tp
    staging = {"broadcast staging (the TP ranks it feeds)": fed * cfg.sync.num_bucket_slots * slot}
    gathered = dims.largest_sync_group * engine_dtype
    transient = 4 * max(dims.layer_params, kept_group_params(dims))
    return [
        Phase("startup", {**contexts, "trainer params (fp32 shard)": shard,
                          "sharding transient (largest group, fp32)": transient}),
        Phase("rollout", {**contexts, "trainer params + optimizer": kept, **staging}),
        Phase("train", {**contexts, "trainer params + grads + optimizer": training_state,
                        **micro_batch_bytes(cfg, dims, "cuda"), **staging}),
        Phase("sync", {**contexts, "trainer params + optimizer": kept, **staging,
                       "gather buffer (largest group + send chunk)": gathered + gathered // world}),
    ]


def _cuda_phases(cfg: JobConfig, dims: ModelDims, plan: SwitchPlan, gpu_bytes: int) -> list[Phase]:
    """One GPU = one slot: trainer rank (an FSDP2 shard of 1/world) + one engine TP worker (1/tp of the weights)."""
    if cfg.placement.split:
        return _split_cuda_phases(cfg, dims)
    world, tp = cfg.placement.num_slots, cfg.engine.tp
    engine_dtype = DTYPE_BYTES[cfg.engine.dtype]
    shard = 4 * dims.num_params // world  # fp32 params
    # with grads and AdamW's two moments of every trained parameter (trainer_state_bytes)
    kept, training_state = (num_bytes // world for num_bytes in trainer_state_bytes(cfg, dims))
    num_communicators = (world > 1) + (tp > 1)  # the trainer's FSDP2 group, the engine worker's TP group
    contexts = {"cuda contexts (2 processes, est.)": 2 * CUDA_CONTEXT_BYTES,
                f"nccl communicators ({num_communicators}, est.)": num_communicators * NCCL_COMMUNICATOR_BYTES}
    # vLLM's budget holds its weights, KV cache and activations; it refuses to start with less free than this
    engine_share = {"engine (gpu_memory_utilization)": int(cfg.engine.gpu_memory_utilization * gpu_bytes)}
    # the ring lives in the engine worker outside vLLM's sleep pool (CUDA IPC cannot export cuMem memory), so it
    # is resident in every phase once opened
    slot = int(cfg.sync.bucket_mb * MIB) if cfg.sync.bucket_mb > 0 else dims.largest_sync_group * engine_dtype // tp
    ring = {"sync ring": cfg.sync.num_bucket_slots * slot}
    # FSDP2 moves each group to the device whole, then shards it: the largest group is a transient, which the
    # caching allocator keeps reserved until the trainer empties its cache (it does, before the engines start)
    transient = 4 * max(dims.layer_params, kept_group_params(dims))  # trainer/fsdp.py's groups
    residue = {"engine outside its sleep pool (est.)": ENGINE_ASLEEP_BYTES}
    if cfg.engine.enforce_eager != "true":  # CUDA graphs ("auto" captures them on CUDA)
        residue["cuda graph pool, kept asleep (est.)"] = CUDA_GRAPH_POOL_BYTES
    awake = plan.engine_sleep_level == 0
    served = _cuda_reward_model(cfg, gpu_bytes, asleep=False)  # starts last, beside everything above
    # the CUDA sync all-gathers each layer group over the trainers, in the engine dtype: the full group plus this
    # rank's send chunk
    gathered = dims.largest_sync_group * engine_dtype if sync_transport(cfg, "cuda") == "gather" else 0
    return [
        # the trainers shard (and empty torch's cache) before the engines start: the transient and the engine's
        # claim are never resident together; the larger of the two is the startup peak
        Phase("startup", {**contexts, "trainer params (fp32 shard)": shard,
                          **({"sharding transient (largest group, fp32)": transient}
                             if transient > sum(engine_share.values()) + sum(ring.values()) + sum(served.values())
                             else {**engine_share, **ring, **served})}),
        Phase("rollout", {**contexts, **engine_share, **ring, **served,
                          **({} if plan.trainer_offload else {"trainer params + optimizer": kept})}),
        Phase("train", {**contexts, "trainer params + grads + optimizer": training_state,
                        **micro_batch_bytes(cfg, dims, "cuda"), **_cuda_reward_model(cfg, gpu_bytes, asleep=not awake),
                        **(engine_share if awake else residue), **ring}),
        # grads were released; the engine woke its weights only, the KV cache stays asleep
        Phase("sync", {**contexts, "trainer params + optimizer": kept,
                       **_cuda_reward_model(cfg, gpu_bytes, asleep=not awake),
                       **(engine_share if awake else
                          {"engine weights (woken)": dims.num_params * engine_dtype // tp, **residue}),
                       **ring, "gather buffer (largest group + send chunk)": gathered + gathered // world}),
    ]


# ---------------------------------------------------------------------------------------------------------------
# What must move: the least that lets every phase fit.


def _chosen_level(cfg: JobConfig) -> int | None:
    return None if cfg.engine.sleep_level == "auto" else int(cfg.engine.sleep_level)


def _chosen_offload(cfg: JobConfig) -> bool | None:
    return None if cfg.trainer.offload == "auto" else cfg.trainer.offload == "true"


# the next rollout runs while this step trains: both sides resident through every phase (JobConfig refuses a
# sleep level or an offload chosen against it)
ONE_STEP_OFF_PLAN = SwitchPlan(0, False, "algo.mode=one_step_off: the engine stays awake and the trainer's state "
                                         "stays (the next step's rollout runs during training)")
ASYNC_PLAN = SwitchPlan(0, False, "algo.mode=async: the engine stays awake and the trainer's state stays (the engines "
                                  "generate without pause)")
OVERLAPPED_PLANS = {"one_step_off": ONE_STEP_OFF_PLAN, "async": ASYNC_PLAN}
# engines and trainers on separate devices (JobConfig refuses a sleep level or an offload chosen against it)
SPLIT_PLAN = SwitchPlan(0, False, "placement.engine_slots > 0: the engines and the trainers have their devices to "
                                  "themselves, so nothing sleeps or moves")


def _fixed_plan(cfg: JobConfig) -> SwitchPlan | None:
    """The plan a split placement or an overlapped mode dictates (None: the switch plan is chosen)."""
    if cfg.placement.split:
        return SPLIT_PLAN
    return OVERLAPPED_PLANS.get(cfg.algo.mode)


def default_plan(cfg: JobConfig, reason: str = "") -> SwitchPlan:
    """The user's explicit choices; where 'auto', everything moves (what is safe without a prediction)."""
    if fixed := _fixed_plan(cfg):
        return fixed
    level, offload = _chosen_level(cfg), _chosen_offload(cfg)
    return SwitchPlan(2 if level is None else level, True if offload is None else offload, reason)


def plan_switch(cfg: JobConfig, dims: ModelDims, *, device: str, available_bytes: int) -> SwitchPlan:
    """Explicit `engine.sleep_level` / `trainer.offload` are obeyed; 'auto' picks the least movement that fits.

    The engine stays awake (0) when the train and sync phases fit beside it, else sleeps at level 2 (the sync
    rewrites every weight, so level 1's host copy is wasted work). The trainer keeps its state when the rollout
    fits beside it, else offloads. The two are independent: the trainer is resident in train and sync whatever
    the plan, and the engine is awake in the rollout whatever the plan."""
    if fixed := _fixed_plan(cfg):  # nothing to choose; check_fits refuses it when a phase cannot hold both
        return fixed
    budget = budget_bytes(available_bytes, device=device)
    where = f"one GPU of {available_bytes / GIB:.1f} GiB" if device == "cuda" else \
        f"this machine's {available_bytes / GIB:.1f} GiB available"
    level, offload = _chosen_level(cfg), _chosen_offload(cfg)
    if level is None:
        awake = {p.name: p for p in predict_phases(cfg, dims, device=device, plan=SwitchPlan(0, True, ""),
                                                   gpu_bytes=available_bytes)}
        worst = max(awake["train"], awake["sync"], key=lambda p: p.total)
        engine = sum(v for k, v in worst.parts.items() if k.startswith("engine"))
        level = 0 if worst.total <= budget else 2
        engine_note = (f"engine stays awake: train and sync fit beside it (peak {worst.name} {_gib(worst.total)} of "
                       f"the {_gib(budget)} allowed on {where})") if level == 0 else \
            (f"engine sleeps (level 2): {worst.name} needs {_gib(worst.total - engine)} beside the engine's "
             f"{_gib(engine)}, over the {_gib(budget)} allowed on {where}")
    else:
        engine_note = f"engine sleep level {level} (engine.sleep_level={level})"
    if offload is None:
        resident = next(p for p in predict_phases(cfg, dims, device=device, plan=SwitchPlan(level, False, ""),
                                                  gpu_bytes=available_bytes) if p.name == "rollout")
        offload = resident.total > budget
        trainer_note = (f"trainer state offloaded: rollout needs {_gib(resident.total)} with it, over "
                        f"{_gib(budget)}") if offload else "trainer state stays (rollout fits beside it)"
    else:
        trainer_note = f"trainer state {'offloaded' if offload else 'stays'} (trainer.offload={str(offload).lower()})"
    return SwitchPlan(level, offload, f"{engine_note}; {trainer_note}")


def switch_plan(cfg: JobConfig, *, device: str, available_bytes: int | None = None) -> SwitchPlan:
    """The plan for this machine (or for `available_bytes`: CPU host memory available, CUDA one GPU's total)."""
    dims = model_dims(cfg)
    if dims is None:
        return default_plan(cfg, f"model dims unknown ({cfg.model.path!r} is neither a local directory nor in the "
                                 "Hugging Face cache): everything moves unless chosen (engine.sleep_level, "
                                 "trainer.offload)")
    available = available_bytes if available_bytes is not None else machine_bytes(device)
    return plan_switch(cfg, dims, device=device, available_bytes=available)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


# ---------------------------------------------------------------------------------------------------------------
# The machine, and the check


def gpu_total_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def host_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def machine_bytes(device: str) -> int:
    return gpu_total_bytes() if device == "cuda" else host_available_bytes()


def budget_bytes(available_bytes: int, *, device: str) -> int:
    return int(available_bytes * (1 - (GPU_HEADROOM if device == "cuda" else HEADROOM)))


def check_fits(phases: list[Phase], *, available_bytes: int, cfg: JobConfig, device: str,
               plan: SwitchPlan | None = None) -> None:
    budget = budget_bytes(available_bytes, device=device)
    for phase in phases:
        if phase.total > budget:
            largest = max(phase.parts, key=phase.parts.get)
            where = "this machine's available memory" if device == "cpu" else \
                f"one GPU ({available_bytes / GIB:.1f} GiB)"
            raise ConfigError(
                f"memory preflight: phase '{phase.name}' needs {phase.total / GIB:.1f} GiB but {where} allows "
                f"{budget / GIB:.1f} GiB (short by {(phase.total - budget) / GIB:.1f} GiB; largest part: {largest} "
                f"{phase.parts[largest] / GIB:.1f} GiB); {_advice(phase, largest, cfg, plan or default_plan(cfg))}")


def _advice(phase: Phase, largest: str, cfg: JobConfig, plan: SwitchPlan) -> str:
    if largest.startswith("reward model"):
        return (f"lower reward_model.gpu_memory_utilization (now {cfg.reward_model.gpu_memory_utilization}) or "
                f"reward_model.kv_cache_gib (now {cfg.reward_model.kv_cache_gib}), or serve a smaller reward model")
    if cfg.placement.split:  # nothing moves between phases, whatever the mode
        return ("a split placement moves nothing between phases: give the trainers more slots (placement.num_slots "
                f"- placement.engine_slots, now {cfg.placement.num_trainer_ranks}), lower engine.kv_cache_gib, or "
                "co-locate (placement.engine_slots=0)")
    if cfg.algo.mode in OVERLAPPED_PLANS:  # the mode forbids every movement
        meanwhile = {"one_step_off": "the next rollout runs", "async": "the engines generate"}[cfg.algo.mode]
        return (f"algo.mode={cfg.algo.mode} keeps the engine awake beside the training trainer ({meanwhile} "
                "meanwhile); use algo.mode=sync, whose switches free this memory, or lower engine.kv_cache_gib / "
                "engine.gpu_memory_utilization")
    # a movement the user forbade comes first: 'auto' would have made that phase fit if it could
    if phase.name in ("train", "sync") and plan.engine_sleep_level == 0:
        return f"use engine.sleep_level=auto or 2 (now {cfg.engine.sleep_level}: the engine stays awake in training)"
    if phase.name == "rollout" and phase.parts.get("trainer params + optimizer"):
        return f"use trainer.offload=auto or true (now {cfg.trainer.offload}: its state stays beside the engine)"
    if "kv cache" in largest:
        return f"lower engine.kv_cache_gib (now {cfg.engine.kv_cache_gib})"
    if "gpu_memory_utilization" in largest:
        return f"lower engine.gpu_memory_utilization (now {cfg.engine.gpu_memory_utilization})"
    if "host copy" in largest:
        return "use engine.sleep_level=2 (the sync restores the weights)"
    if "ring" in largest:
        return f"lower sync.bucket_mb (now {cfg.sync.bucket_mb})"
    if largest == "attention masks" and cfg.trainer.pack_sequences:
        return (f"lower trainer.max_tokens_per_micro_batch (now {cfg.trainer.max_tokens_per_micro_batch}): a packed "
                "row's mask grows with the square of its tokens (none on CUDA with flash-attn installed and "
                "trainer.mixed_precision=true)")
    if largest == "attention masks":
        return (f"use trainer.micro_batch_size=1 (now {cfg.trainer.micro_batch_size}): one row needs no padding "
                "mask, and every layer keeps a copy of it that grows with the square of the length")
    if largest in ("activations kept for backward", "one layer recomputed") and \
            not cfg.trainer.activation_checkpointing:
        return ("use trainer.activation_checkpointing=true (each layer keeps only its input), or lower "
                f"trainer.micro_batch_size (now {cfg.trainer.micro_batch_size}) or rollout.max_tokens (now "
                f"{cfg.rollout.max_tokens})")
    if largest == "logits and log-softmax" and cfg.trainer.logprob_chunk_tokens is None:
        return "use trainer.logprob_chunk_tokens=1024 (one chunk of logits at a time)"
    if largest in ("activations kept for backward", "logits and log-softmax", "one layer recomputed") and \
            cfg.trainer.max_tokens_per_micro_batch is not None:
        return (f"lower trainer.max_tokens_per_micro_batch (now {cfg.trainer.max_tokens_per_micro_batch}) or "
                f"rollout.max_tokens (now {cfg.rollout.max_tokens})")
    if largest in ("activations kept for backward", "logits and log-softmax", "one layer recomputed"):
        return (f"lower trainer.micro_batch_size (now {cfg.trainer.micro_batch_size}), rollout.max_tokens (now "
                f"{cfg.rollout.max_tokens}) or engine.max_model_len (now {cfg.engine.max_model_len})")
    if "unsharded" in largest and not cfg.trainer.mixed_precision:
        return "use trainer.mixed_precision=true (bf16 gathers), more device slots or a smaller model"
    return "use more device slots (placement.num_slots) or a smaller model"


def check_environment(device: str) -> None:
    """Known traps that break memory switching silently."""
    if device == "cuda" and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        # Not vLLM's sleep mode: vLLM 0.32 turns expandable segments off around its own pool and back on after
        # (vllm/device_allocator/cumem.py, CuMemAllocator.use_memory_pool), so the engine still frees at sleep.
        # torch-memory-saver refuses them (its entrypoint's _sanity_checks; trainer/offload.py), and the ring the
        # engine allocates and shares by CUDA IPC would live in one, which no run of colocate has checked (vLLM
        # measured opening such a handle ~9x slower: distributed/weight_transfer/sharded_rdt_trainer.py).
        raise ConfigError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is invalid with colocate: "
                          "torch-memory-saver (the trainer's offload) refuses it, and the sync ring's CUDA IPC is "
                          "unchecked on expandable segments; unset it")


def preflight(cfg: JobConfig, *, device: str, available_bytes: int | None = None) -> Prediction:
    """Plan the switches, predict every phase under the plan, and raise ConfigError if one cannot fit.
    `available_bytes` describes a machine that need not be this one (CUDA: one GPU's total memory)."""
    check_environment(device)
    available = available_bytes if available_bytes is not None else machine_bytes(device)
    budget = budget_bytes(available, device=device)
    dims = model_dims(cfg)
    if dims is None:
        return Prediction(switch_plan(cfg, device=device), [], device, available, budget)
    plan = plan_switch(cfg, dims, device=device, available_bytes=available)
    phases = predict_phases(cfg, dims, device=device, plan=plan, gpu_bytes=available)
    check_fits(phases, available_bytes=available, cfg=cfg, device=device, plan=plan)
    host = host_needs(cfg, dims, offload=plan.trainer_offload) if device == "cuda" else {}
    return Prediction(plan, phases, device, available, budget, host)
