"""The hardware a simulation runs on: one GPU kind's figures, from its datasheet, replaced where a measurement of
ours exists (marked `measured`), or this machine's CPU as `colocate simulate --calibrate` measured it.

    gpu = hardware("h100")                    # ValueError naming the known ones for an unknown name
    gpu.peak_flops, gpu.hbm_bytes_per_s, gpu.memory_bytes, gpu.link_bytes_per_s, gpu.host_bytes_per_s

Datasheet figures are dense bf16 tensor FLOP/s (no sparsity), HBM bandwidth, memory, the GPU-to-GPU link per
direction (NVLink; PCIe where a card has none) and host copies per direction (PCIe). Sources: NVIDIA's H100,
H200, A100, HGX B200 and L20 product briefs. The H200's measured figures are the first GPU run's
(benchmarks/results/gpu/README.md, docs/gpu.md): a bf16 GEMM at 801 TFLOP/s, device copies at 4.3 TB/s counting
read and write, pinned host copies at 55 GB/s each way, a CUDA context with cuBLAS of 0.75 GB.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from colocate.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 tensor FLOP/s
    hbm_bytes_per_s: float  # bytes read or written per second, all traffic counted
    memory_bytes: float
    link_bytes_per_s: float  # to another GPU of the node, per direction (NVLink, or PCIe without it)
    host_bytes_per_s: float  # pinned host <-> device, per direction
    context_bytes: float = 0.75 * GB  # a CUDA context with cuBLAS (measured on an H200; the same driver stack)
    link_latency_s: float = 10e-6  # one small all-reduce across the TP group (NCCL over NVLink, CUDA graphs)
    step_overhead_s: float = 0.4e-3  # a decode step's scheduling and launch, outside its roofline
    measured: tuple[str, ...] = ()  # the fields a measurement of ours gives, not the datasheet
    # the trainer's model FLOPs utilisation by tokens in a step ((tokens, mfu), ascending): docs/simulate.md
    train_mfu: tuple[tuple[int, float], ...] = ()
    time_slicing_gain: float = 0.99  # two processes on one device at once, over running them in turn (measured)

    def mfu(self, tokens: int) -> float:
        """The train step's MFU at `tokens` per rank and step: log-linear between the calibrated points, flat
        beyond them."""
        points = self.train_mfu or DEFAULT_MFU
        if tokens <= points[0][0]:
            return points[0][1]
        for (t0, m0), (t1, m1) in zip(points, points[1:]):
            if tokens <= t1:
                w = math.log(tokens / t0) / math.log(t1 / t0)
                return m0 + w * (m1 - m0)
        return points[-1][1]


# Measured on one H200 (torch 2.11, FSDP2 world size 1, bf16, activation checkpointing, chunked log-probs), a
# Qwen2.5-7B-shaped model cut to 4 layers; single steps, each after a warm step at 1k tokens (issue 42's table).
H200_TRAIN_TOKENS_PER_S = ((4096, 11388.0), (8192, 20124.0), (16384, 24584.0), (32768, 26433.0))
H200_TRAIN_MFU = ((4096, 0.106), (8192, 0.195), (16384, 0.255), (32768, 0.312))
DEFAULT_MFU = H200_TRAIN_MFU  # a datasheet GPU is assumed to train as the measured H200 does, per peak FLOP

GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 SXM 80GB", peak_flops=989e12, hbm_bytes_per_s=3.35e12, memory_bytes=80 * GB,
                     link_bytes_per_s=450 * GB, host_bytes_per_s=55 * GB),
    "h200": Hardware("H200 141GB (measured where marked)", peak_flops=801e12, hbm_bytes_per_s=4.3e12,
                     memory_bytes=141 * GB, link_bytes_per_s=450 * GB, host_bytes_per_s=55 * GB,
                     measured=("peak_flops", "hbm_bytes_per_s", "host_bytes_per_s", "context_bytes", "train_mfu",
                               "time_slicing_gain"), train_mfu=H200_TRAIN_MFU),
    "a100": Hardware("A100 SXM 80GB", peak_flops=312e12, hbm_bytes_per_s=2.039e12, memory_bytes=80 * GB,
                     link_bytes_per_s=300 * GB, host_bytes_per_s=25 * GB),
    "b200": Hardware("B200 180GB (HGX)", peak_flops=2.25e15, hbm_bytes_per_s=8e12, memory_bytes=180 * GB,
                     link_bytes_per_s=900 * GB, host_bytes_per_s=55 * GB),
    "l20": Hardware("L20 48GB (PCIe, no NVLink)", peak_flops=119.5e12, hbm_bytes_per_s=864 * GB,
                    memory_bytes=48 * GB, link_bytes_per_s=25 * GB, host_bytes_per_s=25 * GB,
                    link_latency_s=30e-6),
}

# The H200's MFU is per its measured 801 TFLOP/s GEMM; the curve was reported against the datasheet's 989
H200_MFU_SCALE = 989e12 / 801e12


def hardware(name: str) -> Hardware:
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in GPUS:
        raise ConfigError(f"--gpu {name!r} is not a GPU colocate simulate knows; valid: {', '.join(GPUS)} "
                         f"(or --calibration FILE from `colocate simulate --calibrate`)")
    gpu = GPUS[key]
    if key == "h200":  # the curve's MFU is of 989 TFLOP/s: the same throughput per the measured peak
        gpu = dataclasses.replace(gpu, train_mfu=tuple((t, m * H200_MFU_SCALE) for t, m in gpu.train_mfu))
    return gpu


@dataclass
class Calibration:
    """This machine measured (`colocate simulate --calibrate`): the figures a Hardware needs, and the decode and
    train curves the CPU does not follow a GPU's roofline for."""

    machine: dict
    decode_step_s: list[tuple[int, int, float]] = field(default_factory=list)  # (running, context total, seconds)
    train_step_s: list[tuple[int, float]] = field(default_factory=list)  # (tokens in the step, seconds)
    sync_s: float = 0.0
    switch_s: dict[str, float] = field(default_factory=dict)  # the switch's halves and their sum, "seconds"
    prefill_s_per_token: float = 0.0
    prompt_tokens: int = 0  # the job's mean prompt, as measured
    num_engines: int = 1
    max_num_seqs: int = 0
    # a decode pass beside a train step: the work done a second with both running, over one running alone
    # (calibrate._overlap_gain); 1.0 (time-sliced) for a calibration made before it was measured
    overlap_gain: float = 1.0
    pass_s: float = 0.0  # a rollout pass's wall time beyond its steps' (0 in calibrations from before it)
    config: list[str] = field(default_factory=list)  # the job it measured: CONFIG and key=value

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text())
            data["decode_step_s"] = [tuple(r) for r in data["decode_step_s"]]
            data["train_step_s"] = [tuple(r) for r in data["train_step_s"]]
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"--calibration {path}: not a calibration `colocate simulate --calibrate` wrote ({e})")
