"""What a job is made of, built once in the driver and handed down: the task, the model's dimensions, the slot
plan, the memory preflight's prediction and every "auto" decided (`check_job`, while it checks), then the model
on this machine and its tokenizer (`set_up_job`). The checks, run_job, the runtime and the controller take these
parts; none builds its own.

    checked = check_job(cfg)              # validate, launch: every check, before anything is written (exit 2)
    cfg = checked.config                  # placement.engine_slots=auto decided: what every later step reads
    setup = set_up_job(cfg, checked)      # run_job: the preset built or the hub id fetched, the tokenizer loaded
    with Runtime(cfg, setup) as rt:       # rt.setup is setup; on a Ray cluster the runtime plans the slots and
        Controller(cfg, rt)               #   decides the autos itself, once it knows the nodes
    Runtime(cfg)                          # alone (a test, a benchmark): it builds bare_setup(cfg), unchecked

Two steps, not one, because `colocate validate` writes nothing and fetches nothing: building a preset writes
model.cache_dir, and a hub id downloads. In the driver only: each actor loads what it needs itself (the trainers
and engines their model, an environment worker its tokenizer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from colocate.config import JobConfig
from colocate.job.checks import GpuNode, check_devices, check_experts, check_lora, check_sources
from colocate.job.engine_restarts import check_engine_restarts
from colocate.job.placement import SlotPlan, local_device_count, plan_slots, resolve_device
from colocate.job.preflight import Prediction, plan_switch
from colocate.job.resolve import Decision, ResolvedJob, place_engines, resolve_job
from colocate.job.split import SplitPredictor
from colocate.models.dims import ModelDims, model_dims
from colocate.models.sources import ensure_model, load_tokenizer
from colocate.rl.tasks import Task, make_task


@dataclass(frozen=True)
class CheckedJob:
    """What the checks built and found; `colocate validate` stops here."""
    config: JobConfig  # the user's with placement.engine_slots decided (an int): what every later step reads
    task: Task  # rollout.task: the checks import it, the controller's prompts and rewards use it
    dims: ModelDims | None  # None: a hub id not on this machine yet (set_up_job reads them once it is)
    slots: SlotPlan | None  # None, with prediction and resolved: a Ray cluster's devices, known once connected
    prediction: Prediction | None  # each phase's memory under the switch plan
    resolved: ResolvedJob | None  # the config with every "auto" decided, from the prediction's switch plan
    placed: tuple[Decision, ...]  # placement.engine_slots=auto's decision (also in resolved's), or ()


@dataclass(frozen=True)
class JobSetup(CheckedJob):
    """A checked job with its model on this machine: what the runtime and the controller take."""
    model_path: str  # a model directory: given, the preset built into model.cache_dir, or the hub id's snapshot
    tokenizer: Any  # the model's (a transformers tokenizer), loaded once for every start of the job


def check_job(cfg: JobConfig, *, node: GpuNode | None = None,
              predictor: SplitPredictor | None = None) -> CheckedJob:
    """Every check before anything is written or started, validate's and launch's, keeping what they build.
    `node`: a GPU node the user describes (`validate --gpus N --gpu-memory-gib G`), not this machine.
    `predictor`: each split's step, for placement.engine_slots=auto (the CLI's, from simulate/split.py)."""
    task, dims = check_sources(cfg)
    # the engines' slots first: the slot plan and the memory preflight check the split the job will run
    device = "cuda" if node is not None else None if cfg.placement.ray_address else \
        resolve_device(cfg.placement.device)
    cfg, placed = place_engines(cfg, device=device, predictor=predictor)
    check_engine_restarts(cfg)  # where an engine can come back depends on the split just decided
    slots, prediction = check_devices(cfg, dims, node=node)
    resolved = None if prediction is None else \
        resolve_job(cfg, switch=prediction.plan, device="cuda" if node is not None else None, placed=placed)
    return CheckedJob(cfg, task, dims, slots, prediction, resolved, placed)


def set_up_job(cfg: JobConfig, checked: CheckedJob) -> JobSetup:
    """The checked job with its model on this machine: built (a preset, once into model.cache_dir) or fetched (a
    hub id, whose dimensions are read and checked now), and its tokenizer loaded."""
    model_path = ensure_model(cfg.model)
    dims = checked.dims
    if dims is None and cfg.model.path:  # a hub id's config.json is on this machine now
        dims = model_dims(cfg)
        check_experts(cfg, dims)
        check_lora(cfg, dims)
    try:
        tokenizer = load_tokenizer(model_path)
    except Exception as e:  # transformers raises many types for a broken or partial model directory
        raise RuntimeError(f"cannot load the tokenizer of model.path={model_path!r}: {e}") from None
    parts = {f.name: getattr(checked, f.name) for f in dataclasses.fields(CheckedJob)}
    return JobSetup(**{**parts, "dims": dims}, model_path=model_path, tokenizer=tokenizer)


def bare_setup(cfg: JobConfig) -> JobSetup:
    """The same parts without the checks, for a runtime started on its own (`Runtime(cfg)`: tests, benchmarks):
    no preflight refuses it, and its switch plan is decided for this machine as it is now. On a Ray cluster the
    runtime plans the slots and decides once connected."""
    device = None if cfg.placement.ray_address else resolve_device(cfg.placement.device)
    cfg, placed = place_engines(cfg, device=device)
    setup = set_up_job(cfg, CheckedJob(cfg, make_task(cfg.rollout.task, length=cfg.rollout.task_length),
                                       model_dims(cfg), None, None, None, placed))
    if device is None:
        return setup
    # after the model is built: the switch plan measures the memory this machine has available now
    return dataclasses.replace(setup, slots=plan_slots(cfg, device=device, num_devices=local_device_count(device)),
                               resolved=resolve_job(cfg, switch=plan_switch(cfg, setup.dims, device=device),
                                                    placed=placed))
