"""Memory preflight: predict each phase's peak from the config and the model, before any actor starts.

Co-located RL's most common failure is an out-of-memory crash mid-run (at wake, when old weights, new weights
and the KV cache coexist). The preflight adds up what each phase keeps resident and stops the job with one line
naming the phase, the shortfall and what to change, instead of letting it crash minutes in.

    phases = predict_phases(cfg, dims, device="cpu")
    check_fits(phases, available_bytes=host_available_bytes(), cfg=cfg)   # ConfigError if a phase cannot fit

On the CPU every part lives in host memory, so a phase's total is summed over all processes of the job (the
trainer ranks, the engine workers, Ray). On CUDA the budget is one GPU: the engine's share is fixed by
`engine.gpu_memory_utilization` and the trainer's shard must fit beside what the sleeping engine keeps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from colocate.config import ConfigError, JobConfig
from colocate.placement import sync_in_place

GIB = 1 << 30
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


@dataclass
class ModelDims:
    num_params: int
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config_dict(cls, d: dict) -> ModelDims:
        d = d.get("text_config", d)
        hidden, inter, layers = d["hidden_size"], d.get("intermediate_size", 4 * d["hidden_size"]), d["num_hidden_layers"]
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or hidden // heads
        kv = d.get("num_key_value_heads", heads)
        attention = hidden * head_dim * (2 * heads + 2 * kv) + head_dim * (heads + 2 * kv)
        per_layer = attention + 3 * hidden * inter + 2 * hidden
        embeddings = d["vocab_size"] * hidden * (1 if d.get("tie_word_embeddings") else 2)
        return cls(layers * per_layer + embeddings + hidden, layers, hidden, d["vocab_size"])


@dataclass
class Phase:
    name: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def model_dims(cfg: JobConfig) -> ModelDims | None:
    """From the preset, or the model directory's config.json (None for a hub id not on this machine)."""
    from dataclasses import asdict

    from colocate import models

    if not cfg.model.path:
        p = models.PRESETS[cfg.model.preset]
        return ModelDims.from_config_dict({**asdict(p), "num_hidden_layers": p.num_layers})
    config_file = Path(cfg.model.path).expanduser() / "config.json"
    if not config_file.is_file():
        return None
    return ModelDims.from_config_dict(json.loads(config_file.read_text()))


def predict_phases(cfg: JobConfig, dims: ModelDims, *, device: str) -> list[Phase]:
    world, tp, engines = cfg.placement.num_slots, cfg.engine.tp, cfg.num_engines
    params = dims.num_params * 4  # fp32 master weights
    engine_weights = dims.num_params * DTYPE_BYTES[cfg.engine.dtype]
    # Sequences are prompt + response: the response is bounded by rollout.max_tokens, the prompt is not known
    # before the task runs; PROMPT_TOKENS is a generous guess, capped by the engine's context.
    tokens = cfg.trainer.micro_batch_size * min(cfg.engine.max_model_len, PROMPT_TOKENS + cfg.rollout.max_tokens)
    # per rank: logits and log-softmax in fp32, plus ~16 hidden-sized fp32 activations per layer kept for backward
    activations = world * tokens * 4 * (3 * dims.vocab_size + 16 * dims.hidden_size * dims.num_layers)
    layer_bytes = engine_weights // max(dims.num_layers, 1)
    ring = engines * cfg.sync.num_bucket_slots * max(int(cfg.sync.bucket_mb * (1 << 20)), layer_bytes)
    if sync_in_place(cfg, device):
        ring = 0  # the trainers write into the engine's own parameters

    if device == "cuda":  # one GPU: the trainer's shard beside the engine's reserved share
        return _cuda_phases(cfg, params // world, activations // world, ring // world)
    kv = engines * tp * int(cfg.engine.kv_cache_gib * GIB)
    base = {"processes": world * TRAINER_PROCESS_BYTES + engines * (tp * ENGINE_WORKER_PROCESS_BYTES
                                                                    + ENGINE_ACTOR_PROCESS_BYTES)
            + RAY_DAEMONS_BYTES + DRIVER_PROCESS_BYTES}
    host_copy = engines * engine_weights if cfg.engine.sleep_level == 1 else 0
    return [
        # every rank loads the full checkpoint before it shards it
        Phase("startup", {**base, "checkpoint loaded on every rank": world * params}),
        # offloaded, the trainer's state waits in a file (page cache the kernel may reclaim), not in a process
        Phase("rollout", {**base, "trainer params + optimizer": 0 if cfg.trainer.offload else 3 * params,
                          "engine weights": engines * engine_weights, "kv cache": kv, "sync ring": ring}),
        Phase("train", {**base, "trainer params + grads + optimizer": 4 * params, "activations": activations,
                        "sync ring": ring, "engine host copy (sleep level 1)": host_copy}),
        Phase("sync", {**base, "trainer params + optimizer": 3 * params, "engine weights": engines * engine_weights,
                       "sync ring": ring}),
    ]


def _cuda_phases(cfg: JobConfig, params_shard: int, activations: int, ring: int) -> list[Phase]:
    total = _gpu_total_bytes()
    engine_share = int(cfg.engine.gpu_memory_utilization * total)
    # asleep, vLLM keeps its CUDA context and allocator state; level 1 keeps no weights on the device either
    engine_asleep = int(0.05 * engine_share)
    return [
        Phase("rollout", {"engine (gpu_memory_utilization)": engine_share, "sync ring": ring}),
        Phase("train", {"trainer params + grads + optimizer": 4 * params_shard, "activations": activations,
                        "engine asleep": engine_asleep, "sync ring": ring}),
    ]


def _gpu_total_bytes() -> int:
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def host_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(phases: list[Phase], *, available_bytes: int, cfg: JobConfig, device: str) -> None:
    budget = int(available_bytes * (1 - HEADROOM))
    for phase in phases:
        if phase.total > budget:
            largest = max(phase.parts, key=phase.parts.get)
            where = "this machine's available memory" if device == "cpu" else "one GPU"
            raise ConfigError(
                f"memory preflight: phase '{phase.name}' needs {phase.total / GIB:.1f} GiB but {where} allows "
                f"{budget / GIB:.1f} GiB (short by {(phase.total - budget) / GIB:.1f} GiB; largest part: {largest} "
                f"{phase.parts[largest] / GIB:.1f} GiB); {_advice(phase, largest, cfg, device)}")


def _advice(phase: Phase, largest: str, cfg: JobConfig, device: str) -> str:
    if "kv cache" in largest:
        return f"lower engine.kv_cache_gib (now {cfg.engine.kv_cache_gib})"
    if "gpu_memory_utilization" in largest:
        return f"lower engine.gpu_memory_utilization (now {cfg.engine.gpu_memory_utilization})"
    if "host copy" in largest:
        return "use engine.sleep_level=2 (the sync restores the weights)"
    if "ring" in largest:
        return f"lower sync.bucket_mb (now {cfg.sync.bucket_mb})"
    if "activations" in largest:
        return f"lower trainer.micro_batch_size (now {cfg.trainer.micro_batch_size}) or engine.max_model_len"
    return "use more device slots (placement.num_slots) or a smaller model"


def check_environment(device: str) -> None:
    """Known traps that break memory switching silently."""
    if device == "cuda" and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise ConfigError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is invalid with colocate: vLLM's sleep "
                          "mode then frees nothing; unset it")


def preflight(cfg: JobConfig, *, device: str) -> list[Phase]:
    check_environment(device)
    dims = model_dims(cfg)
    if dims is None:
        return []
    phases = predict_phases(cfg, dims, device=device)
    available = host_available_bytes() if device == "cpu" else _gpu_total_bytes()
    check_fits(phases, available_bytes=available, cfg=cfg, device=device)
    return phases
