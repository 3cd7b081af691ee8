"""Placement: which device slots exist, and where each trainer rank and engine goes.

One Ray placement group bundle per device slot (a GPU, or a logical CPU slot). Slot s holds trainer rank s and
TP worker s % tp of engine s // tp:

    slot:      0            1            2            3
    trainer:   rank 0       rank 1       rank 2       rank 3        (one FSDP2 group over all slots)
    engine:    E0 tp0       E0 tp1       E1 tp0       E1 tp1        (num_engines = num_slots / tp)

On GPU the co-located actors share the bundle's GPU through fractional GPU requests; on the CPU a slot is one
core's worth of CPU. `plan_slots`, `engine_placement` and `pair_devices` are pure, so layout rules are
unit-tested without Ray.

How vLLM 0.32 places an engine's TP workers (read from its sources; `vllm/v1/executor/ray_executor_v2.py`,
`ray_utils.py`, `envs.py`), and what colocate does about it:
- With TP > 1 the engine runs vLLM's Ray executor (V2 by default: `VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1`). It
  reuses the placement group of the actor it runs in (`ray.util.get_current_placement_group()`, which is why
  engine actors capture child tasks) and puts worker i in bundle `VLLM_RAY_BUNDLE_INDICES[i]`, else in bundles
  0..tp-1 (`get_bundles_sorted_by_node`): every engine would land on the first engine's GPUs. Each worker asks
  `VLLM_RAY_PER_WORKER_GPUS` GPUs (default 1.0), which never fits beside a trainer already holding part of the
  bundle's GPU. So each engine is given its own bundles by index and a fractional share per worker, and its
  driver actor holds no GPU (as vLLM's co-located RLHF example and OpenRLHF do).
- V2 workers see every GPU (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`) and worker i takes the i-th
  smallest physical id among the engine's GPUs on its node, not necessarily its own bundle's GPU. Which trainer
  rank shares a GPU with which worker is therefore read back from the actors (`pair_devices`), never assumed
  from `rank % tp`.
- With TP = 1 the engine runs in-process (no executor): the engine actor itself holds the worker's share.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from colocate.config import JobConfig
from colocate.config.algo import OVERLAPPED_MODES
from colocate.config.fields import overrides
from colocate.config.reward_model import reward_models_in
from colocate.config.schema import slot_layout_fix
from colocate.errors import ConfigError, PlacementError
from colocate.host.devices import cpu_bf16_features

# Fractions of a slot's GPU (or CPU) asked for by each co-located actor; they must sum to <= 1. A reward model
# (rollout.rewards=model:PATH) takes its share from the engines' on its slots: Ray's accounting only (which
# bundle's device an actor sees), the device memory each engine uses is its gpu_memory_utilization.
TRAINER_SHARE = 0.5
ENGINE_SHARE = 0.5
REWARD_MODEL_SHARE = 0.25


@dataclass(frozen=True)
class SlotPlan:
    """num_split_engine_slots 0: co-located, slot s holds trainer rank s and TP worker s % tp of engine s // tp.
    N > 0 (split): slots 0 .. num_slots - N - 1 hold the trainer ranks, the last N the engines, alone:

        slot:      0            1            2            3
        split:     rank 0       rank 1       E0 tp0       E0 tp1        (placement.engine_slots=2, engine.tp=2)
    """

    device: str  # "cpu" or "cuda"
    num_slots: int
    tp: int
    num_split_engine_slots: int = 0
    reward_model_tp: int = 0  # rollout.rewards serves a reward model: TP workers on the engines' first slots

    @property
    def split(self) -> bool:
        return self.num_split_engine_slots > 0

    @property
    def num_trainer_ranks(self) -> int:
        return self.num_slots - self.num_split_engine_slots

    @property
    def num_engines(self) -> int:
        return (self.num_split_engine_slots or self.num_slots) // self.tp

    def engine_slots(self, engine: int) -> list[int]:
        first = self.num_trainer_ranks if self.split else 0
        return list(range(first + engine * self.tp, first + (engine + 1) * self.tp))

    def bundles(self) -> list[dict[str, float]]:
        if self.device == "cuda":
            return [{"GPU": 1.0, "CPU": 1.0} for _ in range(self.num_slots)]
        return [{"CPU": 1.0} for _ in range(self.num_slots)]

    def reward_model_slots(self) -> list[int]:
        first = self.engine_slots(0)[0]
        return list(range(first, first + self.reward_model_tp))

    def describe(self, *, num_experts: int = 0) -> list[str]:
        """The layout, a line per slot. `num_experts` (engine.expert_parallel on a MoE): the experts each engine
        worker holds, as vLLM's default (linear) expert map places them."""
        lines = [f"{self.num_slots} {self.device} slot(s), {self.num_engines} engine(s) x TP={self.tp}, "
                 f"FSDP2 over {self.num_trainer_ranks} rank(s)" + (", split: no slot holds both" if self.split else "")]

        def worker(engine_slot: int) -> str:
            line = f"engine {engine_slot // self.tp} tp worker {engine_slot % self.tp}"
            if num_experts:
                first, count = expert_block(engine_slot % self.tp, self.tp, num_experts)
                line += f" (experts {first}-{first + count - 1} of {num_experts})"
            return line

        for slot in range(self.num_slots):
            if not self.split:
                lines.append(f"  slot {slot}: trainer rank {slot} | {worker(slot)}")
            elif slot < self.num_trainer_ranks:
                lines.append(f"  slot {slot}: trainer rank {slot}")
            else:
                lines.append(f"  slot {slot}: {worker(slot - self.num_trainer_ranks)}")
        for rank, slot in enumerate(self.reward_model_slots()):
            lines[1 + slot] += f" | reward model tp worker {rank}"
        return lines


def expert_block(rank: int, size: int, num_experts: int) -> tuple[int, int]:
    """(first expert, number of experts) of expert-parallel rank `rank` of `size` under vLLM 0.32's linear
    placement (`fused_moe/expert_map_manager.py` determine_expert_map: the first num_experts % size ranks hold one
    more). The sync never relies on it: it reads each worker's own map (engine/experts.py)."""
    base, extra = divmod(num_experts, size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("placement.device='cuda' is invalid: no CUDA device is visible here; valid: auto, cpu",
                          fix={"placement.device": "auto"})
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
        fix = _fewer_slots(cfg, num_devices)
        raise ConfigError(f"placement.num_slots={cfg.placement.num_slots} is invalid: {where} has {num_devices} "
                          f"{kind}; valid: 1..{num_devices} (and a multiple of engine.tp={cfg.engine.tp}), e.g. "
                          f"{overrides(fix)}", fix=fix)
    if cfg.engine.batch_invariant and cfg.placement.engine_slots:
        # vLLM pins NCCL's protocol, algorithm and channels in every batch-invariant worker (model_executor/
        # determinism/batch_invariant.py override_envs_for_invariance); a communicator it shares with a process
        # without the pins hangs unless built inside vllm.utils.nccl.unpinned_nccl_env (its own weight transfer
        # does so). The split placement's broadcast group is such a communicator, untested on a GPU.
        raise ConfigError(f"engine.batch_invariant=True is invalid with placement.engine_slots="
                          f"{cfg.placement.engine_slots}: the split placement's NCCL broadcast to batch-invariant "
                          "engines (whose NCCL settings vLLM pins) is not built yet; valid: false, or "
                          "placement.engine_slots=0 (co-located)", fix={"engine.batch_invariant": False})
    if device == "cpu":
        if cfg.engine.sleep_backend == "vllm":
            raise ConfigError("engine.sleep_backend='vllm' is invalid on a CPU run: vLLM's sleep mode needs CUDA; "
                              "valid: auto, portable", fix={"engine.sleep_backend": "auto"})
        if cfg.rollout.speculative:
            raise ConfigError(f"rollout.speculative={cfg.rollout.speculative!r} is invalid on a CPU run: vLLM 0.32's "
                              "CPU build, sampling at temperature > 0 with drafts, returns tokens its model gives "
                              "almost no probability (scripts/probe_cpu_speculative.py; greedy is right), and RL "
                              "samples; valid on the CPU: empty", fix={"rollout.speculative": ""})
        if cfg.engine.batch_invariant:
            raise ConfigError("engine.batch_invariant=True is invalid on a CPU run: vLLM 0.32's batch-invariant "
                              "kernels are Triton and cuBLAS settings for CUDA/ROCm GPUs and XPU "
                              "(model_executor/determinism/batch_invariant.py), none for the CPU; valid: false",
                              fix={"engine.batch_invariant": False})
        if cfg.trainer.mixed_precision and not cpu_bf16_features():
            raise ConfigError("trainer.mixed_precision=True is invalid on this CPU: it computes bf16 natively only "
                              "with AVX-512 BF16 or AMX (flags avx512_bf16, amx_bf16), which it lacks, and emulated "
                              "bf16 is slower than fp32; valid: false", fix={"trainer.mixed_precision": False})
    elif cfg.sync.method == "in_place":
        raise ConfigError("sync.method='in_place' is invalid on a CUDA run: the engine's weights live in vLLM's "
                          "sleep-mode allocator, which CUDA IPC cannot share; valid: auto, gather",
                          fix={"sync.method": "auto"})
    elif cfg.sync.method == "ring":
        raise ConfigError("sync.method='ring' is invalid on a CUDA run: every trainer rank would map every "
                          "engine worker's ring, but each rank sees only its own GPU; valid: auto, gather",
                          fix={"sync.method": "auto"})
    return SlotPlan(device=device, num_slots=cfg.placement.num_slots, tp=cfg.engine.tp,
                    num_split_engine_slots=cfg.placement.engine_slots,
                    reward_model_tp=cfg.reward_model.tp if reward_models_in(cfg.rollout.rewards) else 0)


def _fewer_slots(cfg: JobConfig, num_devices: int) -> dict[str, int]:
    """The most slots `num_devices` can hold in the job's layout (slot_layout_fix: engine.tp divides them, a split
    leaves the trainers one)."""
    tp, engine_slots = cfg.engine.tp, cfg.placement.engine_slots
    num_slots = num_devices if engine_slots or num_devices < tp else num_devices - num_devices % tp
    return {"placement.num_slots": num_slots,
            **slot_layout_fix(num_slots=num_slots, engine_slots=engine_slots, tp=tp)}


def plan_nodes(plan: SlotPlan, node_devices: dict[str, int]) -> list[str]:
    """The node of every slot on a Ray cluster: each engine's TP group lies within one node (its workers'
    communication and every IPC handover stay on a node; only the trainers' process group crosses nodes).
    Engines fill the nodes with the most devices first. ConfigError names the shortfall, before any actor."""
    kind = "GPUs" if plan.device == "cuda" else "CPU cores"
    order = sorted(node_devices, key=lambda node: (-node_devices[node], node))
    listed = ", ".join(f"{node[:8]} {node_devices[node]}" for node in order)
    largest = max(node_devices.values(), default=0)
    if plan.tp > largest:
        raise ConfigError(f"engine.tp={plan.tp} is invalid on this Ray cluster: an engine's TP workers must share one "
                          f"node, and its largest node has {largest} {kind} (nodes: {listed}); valid: engine.tp <= "
                          f"{largest}, e.g. engine.tp={math.gcd(largest, plan.tp)}",
                          fix={"engine.tp": math.gcd(largest, plan.tp)})
    free = {node: node_devices[node] // plan.tp for node in order}  # engines each node can still hold
    key = "placement.engine_slots" if plan.split else "placement.num_slots"
    if sum(free.values()) < plan.num_engines:
        raise ConfigError(f"{key}={plan.num_split_engine_slots or plan.num_slots} is invalid on this Ray cluster: "
                          f"its {plan.num_engines} engine(s) of engine.tp={plan.tp} need {plan.tp} {kind} each "
                          f"within one node, and its nodes ({listed} {kind}) hold {sum(free.values())}; valid: "
                          f"{key} <= {sum(free.values()) * plan.tp}", fix={key: sum(free.values()) * plan.tp})
    engine_nodes = []
    for _ in range(plan.num_engines):
        node = next(n for n in order if free[n])
        free[node] -= 1
        engine_nodes += [node] * plan.tp
    if not plan.split:
        return engine_nodes
    # split: the trainer ranks take the devices the engines left, in the same node order (plan_slots checked
    # that the cluster has num_slots devices in all)
    left = {node: node_devices[node] - engine_nodes.count(node) for node in order}
    trainer_nodes = [node for node in order for _ in range(left[node])][:plan.num_trainer_ranks]
    assert len(trainer_nodes) == plan.num_trainer_ranks
    return trainer_nodes + engine_nodes


def sync_method(cfg: JobConfig, device: str, *, multi_node: bool = False) -> str:
    """gather (all-gather, then each rank feeds the worker on its device), in_place or ring (CPU, one node:
    every rank writes into every worker's shared memory), broadcast (split placement: over a process group)."""
    if cfg.placement.split:
        return "broadcast"  # JobConfig.check refuses any other choice
    if cfg.sync.method != "auto":
        if multi_node and cfg.sync.method in ("in_place", "ring"):
            raise ConfigError(f"sync.method={cfg.sync.method!r} is invalid for a job across several nodes: "
                              "every trainer rank would write into engines on other nodes' shared memory; valid: "
                              "auto, gather", fix={"sync.method": "auto"})
        return cfg.sync.method
    return "in_place" if device == "cpu" and not multi_node else "gather"


# Measured on one H200 (docs/gpu.md, co-located overlap): compute-bound GEMMs and decode-like memory-bound GEMVs,
# each 6 s alone, took 12.12 s at once from two processes, 0.99x of one after the other (one process, two streams:
# 1.02x). The GPU time-slices processes, so the co-located engine's and trainer's kernels do not run side by side.
TWO_PROCESSES_ON_ONE_GPU = 0.99


def plan_line(cfg: JobConfig, reason: str, *, device: str) -> str:
    """The switch plan's line that `colocate validate` and `colocate launch` print: its `reason`, and for a
    co-located one_step_off or async job on `device` "cuda", that the GPU time-slices the two sides' processes,
    so the mode overlaps nothing there, and the key that does (placement.engine_slots)."""
    if device != "cuda" or cfg.algo.mode not in OVERLAPPED_MODES or cfg.placement.split:
        return reason
    return (f"{reason}; on a GPU the co-located engine and trainer are two processes, which the GPU time-slices "
            f"(two at once took {TWO_PROCESSES_ON_ONE_GPU}x the time of one after the other, measured on an H200), "
            f"so algo.mode={cfg.algo.mode} gains no speed from its overlap here: give the engines GPUs of their own "
            "with placement.engine_slots > 0 (docs/async.md)")


def sync_in_place(cfg: JobConfig, device: str) -> bool:
    """Whether the sync writes straight into the engine's parameters (CPU) instead of through rings."""
    return sync_method(cfg, device) == "in_place"


@dataclass(frozen=True)
class EnginePlacement:
    """Where one engine's driver actor goes and what it asks of Ray; `env` reaches vLLM's executor."""

    bundle: int  # the driver actor's bundle (the engine's first slot)
    driver_share: float  # GPUs the driver actor asks for (CUDA)
    env: dict[str, str]
    cpu_share: float  # CPUs the driver actor asks for


def engine_placement(plan: SlotPlan, engine: int) -> EnginePlacement:
    """When the job serves a reward model (plan.reward_model_tp), it takes REWARD_MODEL_SHARE of the engines'."""
    return _placement(plan.device, plan.engine_slots(engine),
                      ENGINE_SHARE - REWARD_MODEL_SHARE if plan.reward_model_tp else ENGINE_SHARE)


def reward_model_placement(plan: SlotPlan) -> EnginePlacement:
    """The reward model's engine: on the policy engines' first slots (JobConfig.check: there are enough)."""
    return _placement(plan.device, plan.reward_model_slots(), REWARD_MODEL_SHARE)


def _placement(device: str, slots: list[int], share: float) -> EnginePlacement:
    env = {"COLOCATE_ENGINE_SLOTS": ",".join(map(str, slots))}
    driver_share = share
    if device == "cuda" and len(slots) > 1:
        # vLLM's Ray executor starts one worker per slot, in exactly these bundles, each with our share of the
        # bundle's GPU; the driver computes nothing on a GPU, so it holds none (a share would be stranded).
        env.update(VLLM_RAY_BUNDLE_INDICES=",".join(map(str, slots)), VLLM_RAY_PER_WORKER_GPUS=str(share))
        driver_share = 0.0
    return EnginePlacement(bundle=slots[0], driver_share=driver_share, env=env, cpu_share=share)


def pair_devices(trainer_devices: list[str], worker_devices: list[list[str]]) -> list[tuple[int, int] | None]:
    """For each trainer rank, the (engine, tp rank) of the engine worker on the same device, or None (a rank
    with no worker beside it takes part in the gather only). Device ids are read back from the actors (GPU
    UUIDs on CUDA). Every worker must share its device with exactly one trainer rank: that rank feeds it."""
    ranks_on: dict[str, list[int]] = {}
    for rank, device in enumerate(trainer_devices):
        ranks_on.setdefault(device, []).append(rank)
    pairs: list[tuple[int, int] | None] = [None] * len(trainer_devices)
    seen: dict[str, tuple[int, int]] = {}
    for engine, workers in enumerate(worker_devices):
        for tp_rank, device in enumerate(workers):
            if device in seen:
                other = seen[device]
                raise PlacementError(f"engine {engine} tp worker {tp_rank} and engine {other[0]} tp worker "
                                     f"{other[1]} are both on device {device}: engines must get disjoint devices")
            seen[device] = (engine, tp_rank)
            ranks = ranks_on.get(device, [])
            if len(ranks) != 1:
                have = ", ".join(f"rank {r} on {d}" for r, d in enumerate(trainer_devices))
                raise PlacementError(f"engine {engine} tp worker {tp_rank} is on device {device}, which holds "
                                     f"{len(ranks)} trainer ranks (need exactly 1 to feed it; trainers: {have})")
            pairs[ranks[0]] = (engine, tp_rank)
    return pairs


def sleep_backend(cfg: JobConfig, device: str) -> str:
    if cfg.engine.sleep_backend != "auto":
        return cfg.engine.sleep_backend
    return "vllm" if device == "cuda" else "portable"


# ---------------------------------------------------------------------------------------------------------------
# Ray side


def cluster_nodes(device: str) -> dict[str, int]:
    """Devices (GPUs, or CPU cores) of every alive node of the Ray cluster, by node id."""
    import ray

    key = "GPU" if device == "cuda" else "CPU"
    return {n["NodeID"]: int(n["Resources"].get(key, 0)) for n in ray.nodes() if n["Alive"]}


def create_placement_group(plan: SlotPlan, *, slot_nodes: list[str] | None = None, timeout_s: float = 120):
    """One bundle per slot; on a cluster, each bundle pinned to its node (plan_nodes) by Ray's node-id label."""
    import ray
    from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

    selectors = [{NODE_ID_LABEL_KEY: node} for node in slot_nodes] if slot_nodes else None
    group = placement_group(plan.bundles(), strategy="PACK", bundle_label_selector=selectors)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not reserve {plan.num_slots} {plan.device} slot(s) within "
                           f"{timeout_s:.0f} s (resources: {ray.cluster_resources()})")
    return group


def actor_options(group, slot: int, *, cpu_share: float, gpu_share: float = 0.0,
                  env: dict[str, str] | None = None) -> dict:
    """Ray options of an actor in bundle `slot` asking these fractions of the slot's CPU and GPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=slot, placement_group_capture_child_tasks=True),
        "num_cpus": cpu_share,
        "runtime_env": {"env_vars": env or {}},
    }
    if gpu_share:
        options["num_gpus"] = gpu_share
    return options
