"""Placement: which device slots exist, and where each trainer rank and engine goes.

One Ray placement group bundle per device slot (a GPU, or a logical CPU slot). Slot s holds trainer rank s and
TP worker s % tp of engine s // tp:

    slot:      0            1            2            3
    trainer:   rank 0       rank 1       rank 2       rank 3        (one FSDP2 group over all slots)
    engine:    E0 tp0       E0 tp1       E1 tp0       E1 tp1        (num_engines = num_slots / tp)

On GPU the co-located actors share the bundle's GPU through fractional GPU requests; on the CPU a slot is one
core's worth of CPU. `plan_slots` and `check_devices` are pure, so layout rules are unit-tested without Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from colocate.config import ConfigError, JobConfig

# Fractions of a slot's GPU (or CPU) asked for by each co-located actor; they must sum to <= 1.
TRAINER_SHARE = 0.5
ENGINE_SHARE = 0.5


@dataclass(frozen=True)
class SlotPlan:
    device: str  # "cpu" or "cuda"
    num_slots: int
    tp: int

    @property
    def num_engines(self) -> int:
        return self.num_slots // self.tp

    def engine_slots(self, engine: int) -> list[int]:
        return list(range(engine * self.tp, (engine + 1) * self.tp))

    def bundles(self) -> list[dict[str, float]]:
        if self.device == "cuda":
            return [{"GPU": 1.0, "CPU": 1.0} for _ in range(self.num_slots)]
        return [{"CPU": 1.0} for _ in range(self.num_slots)]

    def describe(self) -> list[str]:
        lines = [f"{self.num_slots} {self.device} slot(s), {self.num_engines} engine(s) x TP={self.tp}, "
                 f"FSDP2 over {self.num_slots} rank(s)"]
        for slot in range(self.num_slots):
            lines.append(f"  slot {slot}: trainer rank {slot} | engine {slot // self.tp} tp worker {slot % self.tp}")
        return lines


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("placement.device='cuda' is invalid: no CUDA device is visible here; valid: auto, cpu")
    return requested


def local_device_count(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0))


def plan_slots(cfg: JobConfig, *, device: str, num_devices: int, where: str = "this machine") -> SlotPlan:
    """Check the job against the devices available and return its slot plan; ConfigError names the bad key."""
    kind = "GPUs" if device == "cuda" else "CPU cores"
    if cfg.placement.num_slots > num_devices:
        raise ConfigError(f"placement.num_slots={cfg.placement.num_slots} is invalid: {where} has {num_devices} "
                          f"{kind}; valid: 1..{num_devices} (and a multiple of engine.tp={cfg.engine.tp})")
    if device == "cpu":
        if cfg.engine.sleep_backend == "vllm":
            raise ConfigError("engine.sleep_backend='vllm' is invalid on a CPU run: vLLM's sleep mode needs CUDA; "
                              "valid: auto, portable")
        if cfg.trainer.mixed_precision:
            raise ConfigError("trainer.mixed_precision=True is invalid on a CPU run: bf16 mixed precision is for "
                              "CUDA; valid: false")
    elif cfg.sync.transport == "in_place":
        raise ConfigError("sync.transport='in_place' is invalid on a CUDA run: the engine's weights live in vLLM's "
                          "sleep-mode allocator, which CUDA IPC cannot share; valid: auto, ring")
    return SlotPlan(device=device, num_slots=cfg.placement.num_slots, tp=cfg.engine.tp)


def sync_in_place(cfg: JobConfig, device: str) -> bool:
    """Whether the sync writes straight into the engine's parameters (CPU) or through the ring (CUDA)."""
    return cfg.sync.transport == "in_place" or (cfg.sync.transport == "auto" and device == "cpu")


def sleep_backend(cfg: JobConfig, device: str) -> str:
    if cfg.engine.sleep_backend != "auto":
        return cfg.engine.sleep_backend
    return "vllm" if device == "cuda" else "portable"


# ---------------------------------------------------------------------------------------------------------------
# Ray side


def cluster_device_count(device: str) -> int:
    import ray

    return int(ray.cluster_resources().get("GPU" if device == "cuda" else "CPU", 0))


def create_placement_group(plan: SlotPlan, *, timeout_s: float = 120):
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(plan.bundles(), strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not reserve {plan.num_slots} {plan.device} slot(s) within "
                           f"{timeout_s:.0f} s (resources: {ray.cluster_resources()})")
    return group


def actor_options(group, slot: int, *, share: float, device: str, env: dict[str, str] | None = None) -> dict:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=slot, placement_group_capture_child_tasks=True),
        "num_cpus": share,
        "runtime_env": {"env_vars": env or {}},
    }
    if device == "cuda":
        options["num_gpus"] = share
    return options
