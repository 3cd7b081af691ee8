"""Every "auto" of a job decided once, in the driver, into a ResolvedJob: what the runtime builds and what every
actor receives. No actor decides a setting; `colocate validate` prints these same decisions.

    resolved = resolve_job(cfg, switch=prediction.plan)   # the preflight's plan (job/setup.py check_job)
    resolved = resolve_job(cfg, multi_node=True)          # a Ray cluster's nodes, once connected
    cfg, placed = place_engines(cfg, device="cpu")        # placement.engine_slots=auto, before the slots are read
    resolved.config.engine.sleep_level                    # "0", "1" or "2", never "auto"
    resolved.describe()                                   # what validate prints: each decision and why

Each key's rule lives beside what it concerns (placement: the device, the sync method, the sleep backend;
preflight: the switch plan; offload: the trainer's backend; split: the engines' slots); this module calls each once
and records why. `placement.engine_slots=auto` is decided first and apart (`place_engines`): the slot plan and
the memory preflight read the slots, and check_job runs both before the other decisions.
The checkpoint to resume from (`checkpoint.resume=auto`) is decided with the job's inputs (job/checks.py
`read_inputs`): it needs the model's signature. A job's decisions are made once (job/setup.py `check_job`), and on
a Ray cluster once more by the runtime, when it knows the nodes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from colocate.config import JobConfig
from colocate.config.schema import AUTO, engine_lora_rank
from colocate.job.placement import resolve_device, sleep_backend, sync_method
from colocate.sync.delta_channel import uses_delta
from colocate.job.preflight import SwitchPlan, plan_switch
from colocate.job.split import SplitPredictor, choose_engine_slots
from colocate.models.dims import model_dims


@dataclass(frozen=True)
class Decision:
    key: str
    value: str
    why: str


@dataclass(frozen=True)
class ResolvedJob:
    """The job as it runs: `config` is the user's with every "auto" replaced by its decision."""
    config: JobConfig
    device: str  # "cpu" or "cuda"
    switch: SwitchPlan  # what leaves the device between phases (engine sleep level, trainer offload)
    decisions: tuple[Decision, ...]  # one per key that was "auto", in the order decided

    def describe(self) -> list[str]:
        return [f"{d.key}: {d.value} ({d.why})" for d in self.decisions]

    @property
    def sync_method(self) -> str:
        return self.config.sync.method

    @property
    def sleep_backend(self) -> str:
        return self.config.engine.sleep_backend


def place_engines(cfg: JobConfig, *, device: str | None,
                  predictor: SplitPredictor | None = None) -> tuple[JobConfig, tuple[Decision, ...]]:
    """`cfg` with placement.engine_slots=auto decided into an int (job/split.py), and that decision; `cfg` and ()
    when it is not auto. `device`: the job's ("cpu", "cuda"; None: a Ray cluster's, not known yet). `predictor`:
    each split's step (simulate/split.py), else the most even split."""
    if cfg.placement.engine_slots != AUTO:
        return cfg, ()
    slots, why = choose_engine_slots(cfg, device=device, predictor=predictor)
    placed = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, engine_slots=slots))
    return placed, (Decision("placement.engine_slots", str(slots), why),)


def resolve_job(cfg: JobConfig, *, switch: SwitchPlan | None = None, device: str | None = None,
                multi_node: bool = False, placed: tuple[Decision, ...] = ()) -> ResolvedJob:
    """Decide every "auto" of `cfg`. `switch`: the plan the preflight already made (check_devices), else made
    here for this machine. `device`: the job's device when it is not this machine's (`validate --gpus`).
    `multi_node`: the job's slots span several nodes (known once connected to a cluster). `placed`: the decision
    place_engines made before `cfg` was checked against the devices (placement.engine_slots=auto still in `cfg`
    is decided here, by the rule)."""
    decisions: list[Decision] = []
    described = device is not None  # a node the user described (validate --gpus), not this machine

    def decide(key: str, value: str, why: str) -> str:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) == "auto":
            decisions.append(Decision(key, value, why))
        return value

    device = decide("placement.device", device or resolve_device(cfg.placement.device),
                    "CUDA is available" if (device or resolve_device("auto")) == "cuda" else "no CUDA device")
    cfg, engine_slots = place_engines(cfg, device=device)  # (), when check_job placed them first (`placed`)
    decisions += placed + engine_slots
    switch = switch or plan_switch(cfg, model_dims(cfg), device=device)
    engine_why, _, trainer_why = switch.reason.partition("; ")  # plan_switch's two notes, when it made them
    level = decide("engine.sleep_level", str(switch.engine_sleep_level), engine_why)
    offload = decide("trainer.offload", str(switch.trainer_offload).lower(), trainer_why or engine_why)
    backend = decide("engine.sleep_backend", sleep_backend(cfg, device),
                     "vLLM's sleep mode on CUDA" if device == "cuda" else "the portable backend on the CPU")
    eager = decide("engine.enforce_eager", "true" if cfg.engine.enforce_eager == "true" or
                   (cfg.engine.enforce_eager == "auto" and device == "cpu") else "false",
                   "CUDA graphs on a GPU" if device == "cuda" else "eager on the CPU: starts in seconds, not minutes")
    method = decide("sync.method", sync_method(cfg, device, multi_node=multi_node),
                       "split placement: each TP rank's slice broadcast to every engine over a process group"
                       if cfg.placement.split else
                       "the gather protocol: every handover stays on its rank's node" if multi_node else
                       ("in place: every rank writes into the engine's shared memory" if device == "cpu" else
                        "all-gathered, each rank feeding the engine worker on its GPU"))
    on = uses_delta(cfg.sync.delta, method=method, adapter_only=bool(cfg.trainer.lora.rank))
    delta = decide("sync.delta", str(on).lower(),
                   "the broadcast sends each slice's changes since the last sync (its bytes cross devices)" if on else
                   "a LoRA job syncs its adapters alone" if cfg.trainer.lora.rank else
                   "co-located: the copy runs at memory bandwidth, finding the changes would cost more (docs/delta.md)")
    offload_backend = cfg.trainer.offload_backend  # the CPU has one tier, a file: the key does not apply there
    if device == "cuda" and not described:  # this process's environment is the one the actors inherit
        offload_backend = decide("trainer.offload_backend", _cuda_offload_backend(cfg),
                                 "torch_memory_saver when it is installed and usable here, else pinned host buffers")
    config = dataclasses.replace(
        cfg,
        placement=dataclasses.replace(cfg.placement, device=device),
        engine=dataclasses.replace(cfg.engine, sleep_level=level, sleep_backend=backend, enforce_eager=eager,
                                   # a LoRA job's: given, or the smallest of vLLM's ranks that holds the trainer's
                                   max_lora_rank=engine_lora_rank(cfg.trainer.lora.rank, cfg.engine.max_lora_rank)),
        trainer=dataclasses.replace(cfg.trainer, offload=offload, offload_backend=offload_backend),
        sync=dataclasses.replace(cfg.sync, method=method, delta=delta))
    return ResolvedJob(config, device, switch, tuple(decisions))


def _cuda_offload_backend(cfg: JobConfig) -> str:
    """The backend select_backend picks in this process, whose environment the actors inherit
    (PYTORCH_CUDA_ALLOC_CONF, the installed packages)."""
    import torch

    from colocate.trainer.offload import memory_saver_problem, select_backend

    return select_backend(torch.device("cuda"), backend=cfg.trainer.offload_backend,
                          memory_saver_problem=memory_saver_problem())
