"""The simulator's step for each split placement.engine_slots=auto may take: the SplitPredictor job/split.py scores
them with. job/ cannot import this package (it sits above job/), so the CLI builds it and hands it to check_job.

    predictor = split_predictor(cfg)                                 # this machine's GPU; None where none is modelled
    predictor = split_predictor(cfg, gpu_name="h100", memory_gib=80) # `colocate validate --gpus N --gpu h100`
    check_job(cfg, predictor=predictor)

Each split is the job with that placement.engine_slots on placement.num_slots GPUs, predicted as `colocate
simulate` predicts its split candidates (simulate/step.py `predict`: the memory preflight on the GPU's memory, the
rollout played over steps, training and the broadcast sync beside it, a step the longer side), with answers
log-normal around a quarter of rollout.max_tokens, as `validate --gpus` predicts the job's step. The CPU has no
such model: a calibration (`colocate simulate --calibrate`) measures one layout's engines and trainers, not how
they would run on other slots.
"""

from __future__ import annotations

import dataclasses

from colocate.config import JobConfig
from colocate.config.algo import OVERLAPPED_MODES
from colocate.config.schema import AUTO
from colocate.job.placement import resolve_device
from colocate.job.split import SplitPredictor, StepPrediction
from colocate.models.dims import model_dims
from colocate.simulate.hardware import GPUS, Hardware, hardware
from colocate.simulate.lengths import LengthDistribution
from colocate.simulate.step import predict


def job_lengths(cfg: JobConfig) -> tuple[LengthDistribution, int]:
    """The answers' lengths a prediction of the job as configured assumes (log-normal around a quarter of
    rollout.max_tokens, sigma 0.9), and its prompts' tokens."""
    longest = cfg.rollout.max_tokens
    lengths = LengthDistribution.parse(f"lognormal:{max(1, longest // 4)},0.9,1,{longest}")
    return lengths, cfg.data.max_prompt_tokens or max(1, cfg.engine.max_model_len - longest)


def split_predictor(cfg: JobConfig, *, gpu_name: str | None = None,
                    memory_gib: float | None = None) -> SplitPredictor | None:
    """Each split's step on placement.num_slots GPUs of `gpu_name` (a kind `colocate simulate --gpu` knows; None:
    this machine's GPU, when the simulator knows its kind), with `memory_gib` each (None: the kind's). None where
    nothing is to be chosen (placement.engine_slots is not auto, or the mode does not split) or nothing predicts:
    the CPU, a GPU of another kind, a Ray cluster's, a model whose config.json is not on this machine."""
    if cfg.placement.engine_slots != AUTO or cfg.algo.mode not in OVERLAPPED_MODES:
        return None
    name = gpu_name or (None if cfg.placement.ray_address else local_gpu_kind(cfg))
    if name is None or model_dims(cfg) is None:
        return None
    gpu = hardware(name)
    if memory_gib is not None:
        gpu = dataclasses.replace(gpu, memory_bytes=memory_gib * 2**30)  # GiB, as --gpu-memory-gib
    lengths, prompt_tokens = job_lengths(cfg)
    return gpu_split_predictor(gpu, num_gpus=cfg.placement.num_slots, lengths=lengths, prompt_tokens=prompt_tokens,
                               note=f"a model: answers log-normal around {max(1, cfg.rollout.max_tokens // 4)} "
                                    "tokens, colocate simulate for more")


def gpu_split_predictor(gpu: Hardware, *, num_gpus: int, lengths: LengthDistribution, prompt_tokens: int,
                        note: str) -> SplitPredictor:
    """Each split's step on `num_gpus` of `gpu`, its answers' lengths drawn from `lengths`."""
    def step(job: JobConfig) -> StepPrediction | None:
        p = predict(lambda keys: job, {}, "split", gpu, gpus=num_gpus, lengths=lengths, prompt_tokens=prompt_tokens)
        return StepPrediction(p.step_s, p.trained_tokens_per_s) if p.fits and p.step_s > 0 else None

    return SplitPredictor(where=f"{num_gpus} x {gpu.name}", note=note, predict=step)


def local_gpu_kind(cfg: JobConfig) -> str | None:
    """The simulator's name for this machine's first GPU ("h100" for "NVIDIA H100 80GB HBM3"), None without CUDA
    or for a kind it does not model. The preflight reads the same device's properties in the driver."""
    if resolve_device(cfg.placement.device) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_properties(0).name.lower().replace(" ", "").replace("-", "")
    return next((kind for kind in GPUS if kind in name), None)
