"""Memory preflight: predict each phase's peak from the config and the model, before any actor starts, and
decide what must move between phases (the switch plan).

Co-located RL's most common failure is an out-of-memory crash mid-run (at wake, when old weights, new weights
and the KV cache coexist). The preflight adds up what each phase keeps resident and stops the job with one line
naming the phase, the shortfall and what to change, instead of letting it crash minutes in.

    dims = model_dims(cfg)                                                 # models/dims.py; None: unknown
    result = preflight(cfg, dims, device="cuda", available_bytes=80 * GIB)   # ConfigError if a phase cannot fit
    result.plan.engine_sleep_level, result.plan.trainer_offload          # what the controller must move
    result.phases                                                        # startup, rollout, train, sync, parts
    plan_switch(cfg, dims, device="cpu")                                 # the plan alone, for this machine

On the CPU every part lives in host memory, so a phase's total is summed over all processes of the job (the
trainer ranks, the engine workers, Ray). On CUDA the budget is one GPU, and a slot is one GPU holding one
trainer rank and one engine TP worker: every part is per GPU. docs/preflight.md explains each part.

The arithmetic lives beside: the model's dimensions in models/dims.py, each phase's parts in job/phases.py, the
train step's peaks in job/train_peaks.py (trainer/step_moments.py, moment by moment). Their names stay
importable from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from colocate.config import JobConfig
from colocate.errors import ConfigError
from colocate.host.node_checks import host_needs
from colocate.models.dims import (  # noqa: F401
    ModelDims,
    critic_params,
    model_config_file,
    model_dims,
    num_adapter_params,
    num_routed_experts,
    trainer_state_bytes,
)
from colocate.job.phases import (  # noqa: F401
    CUDA_CONTEXT_BYTES,
    CUDA_GRAPH_POOL_BYTES,
    DRIVER_PROCESS_BYTES,
    DTYPE_BYTES,
    ENGINE_ACTOR_PROCESS_BYTES,
    ENGINE_ASLEEP_BYTES,
    ENGINE_WORKER_PROCESS_BYTES,
    GIB,
    GPU_HEADROOM,
    HEADROOM,
    MIB,
    NCCL_COMMUNICATOR_BYTES,
    NCCL_COMMUNICATOR_PEERS_BYTES,
    RAY_DAEMONS_BYTES,
    TRAINER_PROCESS_BYTES,
    Phase,
    SwitchPlan,
    communicator_bytes,
    cpu_phases,
    cuda_phases,
    delta_store_bytes,
    train_phase_parts,
)
from colocate.job.train_peaks import (  # noqa: F401
    PROMPT_TOKENS,
    TrainPeaks,
    micro_batch_bytes,
    predict_train_peaks,
    train_micro_batch_shape,
)
@dataclass(frozen=True)
class Prediction:
    plan: SwitchPlan
    phases: list[Phase]  # under `plan`; empty when the model's dims are unknown (a hub id)
    device: str
    available_bytes: int  # CPU: the host's available memory; CUDA: one GPU's total memory
    budget_bytes: int  # what a phase may use: available_bytes less the headroom
    host_needs: dict[str, int] = field(default_factory=dict)
    """CUDA: what the node's host memory must hold (node_checks.host_needs); empty on the CPU or without dims."""


def predict_phases(cfg: JobConfig, dims: ModelDims, *, device: str, plan: SwitchPlan | None = None,
                   gpu_bytes: int | None = None) -> list[Phase]:
    """Each phase's resident parts under `plan` (default: the config's explicit choices, everything moving where
    'auto'). CUDA: per GPU of `gpu_bytes` (default: this machine's first GPU)."""
    plan = plan or default_plan(cfg)
    if device == "cuda":
        return cuda_phases(cfg, dims, plan, gpu_bytes if gpu_bytes is not None else gpu_total_bytes())
    return cpu_phases(cfg, dims, plan)



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


def plan_switch(cfg: JobConfig, dims: ModelDims | None, *, device: str,
                available_bytes: int | None = None) -> SwitchPlan:
    """Explicit `engine.sleep_level` / `trainer.offload` are obeyed; 'auto' picks the least movement that fits
    `available_bytes` (CPU: host memory available, CUDA: one GPU's total; default: this machine's).

    The engine stays awake (0) when the train and sync phases fit beside it, else sleeps at level 2 (the sync
    rewrites every weight, so level 1's host copy is wasted work). The trainer keeps its state when the rollout
    fits beside it, else offloads. The two are independent: the trainer is resident in train and sync whatever
    the plan, and the engine is awake in the rollout whatever the plan. Without `dims` (a hub id not on this
    machine) nothing can be predicted: everything moves unless chosen."""
    if fixed := _fixed_plan(cfg):  # nothing to choose; check_fits refuses it when a phase cannot hold both
        return fixed
    if dims is None:
        return default_plan(cfg, f"model dims unknown ({cfg.model.path!r} is neither a local directory nor in the "
                                 "Hugging Face cache): everything moves unless chosen (engine.sleep_level, "
                                 "trainer.offload)")
    available_bytes = available_bytes if available_bytes is not None else machine_bytes(device)
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
    if phase.name == "engine gpu":  # a split placement's engine GPU: vLLM's share and what lies outside it
        return (f"lower engine.gpu_memory_utilization (now {cfg.engine.gpu_memory_utilization}): the worker's "
                "context, communicators and sync ring lie outside vLLM's share")
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


def preflight(cfg: JobConfig, dims: ModelDims | None, *, device: str, available_bytes: int | None = None) -> Prediction:
    """Plan the switches, predict every phase under the plan, and raise ConfigError if one cannot fit. `dims`:
    the model's (models/dims.py; None: unknown, nothing predicted). `available_bytes` describes a machine that
    need not be this one (CUDA: one GPU's total memory)."""
    check_environment(device)
    available = available_bytes if available_bytes is not None else machine_bytes(device)
    budget = budget_bytes(available, device=device)
    if dims is None:
        return Prediction(plan_switch(cfg, None, device=device), [], device, available, budget)
    plan = plan_switch(cfg, dims, device=device, available_bytes=available)
    phases = predict_phases(cfg, dims, device=device, plan=plan, gpu_bytes=available)
    check_fits(phases, available_bytes=available, cfg=cfg, device=device, plan=plan)
    host = host_needs(cfg, dims, offload=plan.trainer_offload, critic_params=critic_params(cfg, dims),
                      delta_store_bytes=delta_store_bytes(cfg, dims)) if device == "cuda" else {}
    if host and cfg.algo.kl_coef > 0 and not cfg.trainer.lora.rank:
        # the reference policy waits offloaded (pinned or torch_memory_saver's host copy) but for its forwards:
        # every rank's shard in the compute dtype (trainer/reference.py)
        host["reference policy's host copy (offloaded)"] = (2 if cfg.trainer.mixed_precision else 4) \
            * dims.num_params
    return Prediction(plan, phases, device, available, budget, host)
