"""What each phase of a step keeps resident, part by part, under a switch plan: the memory preflight's arithmetic
(job/preflight.py plans the switches and checks the phases; docs/preflight.md explains each part).

On the CPU every part lives in host memory, so a phase's total is summed over all processes of the job (the
trainer ranks, the engine workers, Ray). On CUDA the budget is one GPU, and a slot is one GPU holding one
trainer rank and one engine TP worker: every part is per GPU; a split placement has two kinds of GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colocate.config import JobConfig
from colocate.config.reward_model import reward_models_in
from colocate.models.dims import ModelDims, critic_params, num_adapter_params, trainer_state_bytes
from colocate.job.placement import sync_in_place, sync_method
from colocate.job.train_peaks import TrainPeaks, predict_train_peaks

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
HEADROOM = 0.10  # leave this fraction of the available memory to the OS and page cache

# CUDA, per process. Measured on one H200 (torch 2.11, CUDA 13, NCCL 2.28.9; colocate/bench/gpu_check's constants
# section: the driver's free memory before and after, read from outside the process): a context with cuBLAS loaded
# by a first matmul 0.75 GB (estimated 0.5 before), an NCCL communicator of world size 1 0.61 GB; counted here as
# GiB, the larger reading.
CUDA_CONTEXT_BYTES = int(0.75 * GIB)  # per process (trainer rank, engine worker): context, kernels, cuBLAS
# An NCCL communicator: its context share and buffers. The trainer's group exists at every world size (the
# gradient norm's all-reduce and the finite checks' create it, trainer/finite.py), an engine worker's TP group when
# tp > 1. vLLM creates its TP group *before* the snapshot its memory budget starts from
# (vllm/v1/worker/gpu_worker.py, init_device: "Initialize the distributed environment BEFORE taking memory
# snapshot"), so it lies outside gpu_memory_utilization, as the context does. World size 1 is measured; more ranks
# add each peer's buffers (NCCL_BUFFSIZE, 4 MiB per channel and peer by default, per protocol): not measured on
# our GPUs, an estimate from the 0.5-1.5 GiB per process reported for 8-GPU nodes.
NCCL_COMMUNICATOR_BYTES = int(0.61 * GIB)
NCCL_COMMUNICATOR_PEERS_BYTES = int(1.0 * GIB)  # a communicator of more than one rank (est.)
# What an engine keeps outside vLLM's cuMem sleep pool while asleep: torch's cache, the sampler's buffers (est.)
ENGINE_ASLEEP_BYTES = int(0.5 * GIB)
# CUDA graphs' memory pool: inside the budget while awake (vLLM 0.32 subtracts its estimate from the KV cache,
# VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default), but resident while asleep
# (ModelConfig.sleep_mode_offload_cudagraph=False by default, vllm/config/model.py); est.
CUDA_GRAPH_POOL_BYTES = int(1.0 * GIB)
GPU_HEADROOM = 0.03  # fragmentation of two caching allocators




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


def train_phase_parts(peaks: TrainPeaks) -> dict[str, int]:
    """A trainer rank's part of the train phase: its resident state with the gradients its step's largest moment
    holds, and that moment's other parts (job/train_peaks.py)."""
    parts = dict(peaks.peak_parts)
    grads = parts.pop("gradients (fp32 shard)", 0)
    return {"trainer params + grads + optimizer": peaks.resident_bytes + grads, **parts}


CRITIC_KEPT = "critic params + optimizer"


def critic_parts(cfg: JobConfig, dims: ModelDims, *, ranks: int) -> dict[str, dict[str, int]]:
    """The value model's parts (algo.advantage=gae; empty without a critic) in each phase, for `ranks` of the
    world's trainer ranks (CPU: all of them, the host holds every rank; CUDA: 1, a GPU holds one), keyed by phase.
    It lives in the trainer's processes and moves with the policy's state (trainer/critic.py): resident where the
    policy's is, offloaded with it for the rollout. In training the policy's step runs, its gradients are dropped,
    then the critic's: the critic's pass is the policy's without the vocabulary's logits, beside the policy's
    resident state, so the train phase's peak is the policy step's plus the critic's state, and the critic's
    gradients where they outgrow the policy's (a critic model of its own larger than the policy)."""
    n = critic_params(cfg, dims)
    if not n:
        return {}
    world = cfg.placement.num_trainer_ranks
    trained = num_adapter_params(cfg, dims) if cfg.trainer.lora.rank else dims.num_params
    share = ranks / world
    kept = {CRITIC_KEPT: int(12 * n * share)}
    return {"startup": {"critic params (fp32 shards)": int(4 * n * share)}, "rollout": kept, "sync": kept,
            "train": {**kept, "critic gradients beyond the policy's": int(4 * max(0, n - trained) * share)}}


def with_critic(phases: list[Phase], critic: dict[str, dict[str, int]], *, offloaded: bool) -> list[Phase]:
    """`phases` with the critic's parts added to those it is resident in (the rollout only when not offloaded)."""
    for phase in phases:
        parts = critic.get(phase.name, {})
        if phase.name == "rollout" and offloaded:
            parts = {key: 0 for key in parts}
        phase.parts.update(parts)
    return phases


DELTA_STORES = "delta weight stores (host)"


def delta_store_bytes(cfg: JobConfig, dims: ModelDims) -> int:
    """sync.delta's weight stores (sync/delta_channel.py), all in host memory: the feeders hold every TP rank's
    slice once (the whole model in the engine dtype), and every engine worker its own slice (each engine the
    whole model); 0 where the job sends no delta."""
    from colocate.sync.delta_channel import uses_delta

    if not cfg.placement.split or not uses_delta(cfg.sync.delta, method="broadcast",
                                                 adapter_only=bool(cfg.trainer.lora.rank)):
        return 0
    return (1 + cfg.num_engines) * dims.num_params * DTYPE_BYTES[cfg.engine.dtype]


def cpu_phases(cfg: JobConfig, dims: ModelDims, plan: SwitchPlan) -> list[Phase]:
    phases = with_critic(_cpu_phases(cfg, dims, plan), critic_parts(cfg, dims, ranks=cfg.placement.num_trainer_ranks),
                         offloaded=plan.trainer_offload)
    if stores := delta_store_bytes(cfg, dims):  # held from the first sync on, in every phase after it
        for phase in phases[1:]:
            phase.parts[DELTA_STORES] = stores
    return phases


def _cpu_phases(cfg: JobConfig, dims: ModelDims, plan: SwitchPlan) -> list[Phase]:
    world, tp, engines = cfg.placement.num_trainer_ranks, cfg.engine.tp, cfg.num_engines
    params = dims.num_params * 4  # fp32 master weights
    kept, _ = trainer_state_bytes(cfg, dims)
    engine_weights = engines * dims.num_params * DTYPE_BYTES[cfg.engine.dtype]
    # every rank's step, in host memory
    training = {part: world * num_bytes
                for part, num_bytes in train_phase_parts(predict_train_peaks(cfg, dims, device="cpu")).items()}
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
        Phase("train", {**base, **training, "sync ring": ring, **engine_in_train}),
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


def communicator_bytes(size: int) -> int:
    """One NCCL communicator of `size` ranks, per process (the constants above)."""
    return NCCL_COMMUNICATOR_BYTES if size == 1 else NCCL_COMMUNICATOR_PEERS_BYTES


def _cuda_graphs(cfg: JobConfig) -> bool:
    return cfg.engine.enforce_eager != "true"  # "auto" captures them on CUDA; the reward model runs the same way


def _cuda_reward_model(cfg: JobConfig, gpu_bytes: int, *, asleep: bool) -> dict[str, int]:
    """The reward model's part of one of its GPUs (the first reward_model.tp slots of the policy's engines): its
    context and TP communicator (outside its budget, as the policy engine's), and its budget while awake; asleep
    (level 1, with the policy's engines) what vLLM keeps outside its sleep pool and its CUDA graphs' pool."""
    if not reward_models_in(cfg.rollout.rewards):
        return {}
    tp = cfg.reward_model.tp
    outside = {"reward model (context, est.)": CUDA_CONTEXT_BYTES,
               **({f"reward model's tp communicator ({tp} ranks, est.)": communicator_bytes(tp)} if tp > 1 else {})}
    if asleep:
        return {**outside, "reward model asleep (outside its sleep pool, est.)": ENGINE_ASLEEP_BYTES,
                **({"reward model's cuda graph pool, kept asleep (est.)": CUDA_GRAPH_POOL_BYTES}
                   if _cuda_graphs(cfg) else {})}
    return {**outside, "reward model (reward_model.gpu_memory_utilization)":
            int(cfg.reward_model.gpu_memory_utilization * gpu_bytes)}


def _ring_slot_bytes(cfg: JobConfig, dims: ModelDims) -> int:
    engine_dtype = DTYPE_BYTES[cfg.engine.dtype]
    return int(cfg.sync.bucket_mb * MIB) if cfg.sync.bucket_mb > 0 else \
        dims.largest_sync_group * engine_dtype // cfg.engine.tp


def _sharding_transient(dims: ModelDims) -> int:
    """FSDP2 moves each group to the device whole, then shards it (trainer/fsdp.py): the largest group in fp32."""
    untied_table = 0 if dims.tie_word_embeddings else dims.vocab_size * dims.hidden_size
    return 4 * max(dims.layer_params, untied_table or dims.root_params)


def _split_cuda_phases(cfg: JobConfig, dims: ModelDims, gpu_bytes: int) -> list[Phase]:
    """A split placement's two kinds of GPU. A trainer rank's: its shard, its training, the gather and the
    broadcast staging. An engine worker's, the same in every phase (nothing sleeps): vLLM's share
    (engine.gpu_memory_utilization, which vLLM checks is free as it starts), and what it does not count: its
    context, its TP and broadcast communicators, its ring, and the reward model where it is served (the first
    reward_model.tp engine slots)."""
    world, tp = cfg.placement.num_trainer_ranks, cfg.engine.tp
    engine_dtype = DTYPE_BYTES[cfg.engine.dtype]
    shard = 4 * dims.num_params // world
    kept = trainer_state_bytes(cfg, dims)[0] // world
    fed = -(-tp // world)  # the TP ranks the busiest rank feeds: a broadcast group and a staging ring each
    broadcast_size = 1 + cfg.num_engines  # a feeder and that TP rank of every engine (job/groups.py)
    contexts = {"cuda context (est.)": CUDA_CONTEXT_BYTES,
                f"nccl communicators (fsdp2 of {world}, {fed} broadcast of {broadcast_size}; est.)":
                    communicator_bytes(world) + fed * communicator_bytes(broadcast_size)}
    slot = _ring_slot_bytes(cfg, dims)
    staging = {"broadcast staging (the TP ranks it feeds)": fed * cfg.sync.num_bucket_slots * slot}
    gathered = dims.largest_sync_group * engine_dtype
    engine_gpu = {"cuda context (engine worker, est.)": CUDA_CONTEXT_BYTES,
                  f"nccl communicators ({'tp of %d, ' % tp if tp > 1 else ''}broadcast of {broadcast_size}; est.)":
                      (communicator_bytes(tp) if tp > 1 else 0) + communicator_bytes(broadcast_size),
                  "engine (gpu_memory_utilization)": int(cfg.engine.gpu_memory_utilization * gpu_bytes),
                  "sync ring": cfg.sync.num_bucket_slots * slot,
                  **_cuda_reward_model(cfg, gpu_bytes, asleep=False)}
    return [
        Phase("startup", {**contexts, "trainer params (fp32 shard)": shard,
                          "sharding transient (largest group, fp32)": _sharding_transient(dims)}),
        Phase("rollout", {**contexts, "trainer params + optimizer": kept, **staging}),
        Phase("train", {**contexts, **train_phase_parts(predict_train_peaks(cfg, dims, device="cuda")),
                        **staging}),
        Phase("sync", {**contexts, "trainer params + optimizer": kept, **staging,
                       "gather buffer (largest group + send chunk)": gathered + gathered // world}),
        Phase("engine gpu", engine_gpu),
    ]


def cuda_phases(cfg: JobConfig, dims: ModelDims, plan: SwitchPlan, gpu_bytes: int) -> list[Phase]:
    """One GPU = one slot: trainer rank (an FSDP2 shard of 1/world) + one engine TP worker (1/tp of the weights)."""
    critic = critic_parts(cfg, dims, ranks=1)
    if cfg.placement.split:
        return with_critic(_split_cuda_phases(cfg, dims, gpu_bytes), critic, offloaded=False)
    return with_critic(_colocated_cuda_phases(cfg, dims, plan, gpu_bytes), critic, offloaded=plan.trainer_offload)


def _colocated_cuda_phases(cfg: JobConfig, dims: ModelDims, plan: SwitchPlan, gpu_bytes: int) -> list[Phase]:
    world, tp = cfg.placement.num_slots, cfg.engine.tp
    engine_dtype = DTYPE_BYTES[cfg.engine.dtype]
    shard = 4 * dims.num_params // world  # fp32 params
    # with AdamW's two moments of every trained parameter (trainer_state_bytes)
    kept = trainer_state_bytes(cfg, dims)[0] // world
    groups = f"fsdp2 of {world}" + (f", tp of {tp}" if tp > 1 else "")
    contexts = {"cuda contexts (2 processes, est.)": 2 * CUDA_CONTEXT_BYTES,
                f"nccl communicators ({groups}; est.)": communicator_bytes(world)
                + (communicator_bytes(tp) if tp > 1 else 0)}
    # vLLM's budget holds its weights, KV cache and activations; it refuses to start with less free than this
    engine_share = {"engine (gpu_memory_utilization)": int(cfg.engine.gpu_memory_utilization * gpu_bytes)}
    # the ring lives in the engine worker outside vLLM's sleep pool (CUDA IPC cannot export cuMem memory), so it
    # is resident in every phase once opened
    ring = {"sync ring": cfg.sync.num_bucket_slots * _ring_slot_bytes(cfg, dims)}
    # the largest group's transient stays in the caching allocator until the trainer empties its cache (it does,
    # before the engines start)
    transient = _sharding_transient(dims)
    residue = {"engine outside its sleep pool (est.)": ENGINE_ASLEEP_BYTES}
    if _cuda_graphs(cfg):
        residue["cuda graph pool, kept asleep (est.)"] = CUDA_GRAPH_POOL_BYTES
    awake = plan.engine_sleep_level == 0
    served = _cuda_reward_model(cfg, gpu_bytes, asleep=False)  # starts last, beside everything above
    # the CUDA sync all-gathers each layer group over the trainers, in the engine dtype: the full group plus this
    # rank's send chunk
    gathered = dims.largest_sync_group * engine_dtype if sync_method(cfg, "cuda") == "gather" else 0
    return [
        # the trainers shard (and empty torch's cache) before the engines start: the transient and the engine's
        # claim are never resident together; the larger of the two is the startup peak
        Phase("startup", {**contexts, "trainer params (fp32 shard)": shard,
                          **({"sharding transient (largest group, fp32)": transient}
                             if transient > sum(engine_share.values()) + sum(ring.values()) + sum(served.values())
                             else {**engine_share, **ring, **served})}),
        Phase("rollout", {**contexts, **engine_share, **ring, **served,
                          **({} if plan.trainer_offload else {"trainer params + optimizer": kept})}),
        Phase("train", {**contexts, **train_phase_parts(predict_train_peaks(cfg, dims, device="cuda")),
                        **_cuda_reward_model(cfg, gpu_bytes, asleep=not awake),
                        **(engine_share if awake else residue), **ring}),
        # grads were released; the engine woke its weights only, the KV cache stays asleep
        Phase("sync", {**contexts, "trainer params + optimizer": kept,
                       **_cuda_reward_model(cfg, gpu_bytes, asleep=not awake),
                       **(engine_share if awake else
                          {"engine weights (woken)": dims.num_params * engine_dtype // tp, **residue}),
                       **ring, "gather buffer (largest group + send chunk)": gathered + gathered // world}),
    ]
