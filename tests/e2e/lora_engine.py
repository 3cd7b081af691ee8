"""One LoRA engine driven through its actor's calls, outside any job: what the e2e test (the CPU, in a fresh process,
since vLLM configures the process it runs in) and its GPU twin (tests/gpu/test_cuda_lora.py) check.

    python tests/e2e/lora_engine.py cpu tiny-moe --tp 2 --expert-parallel --rank 4 --cache-dir DIR   # one JSON line

The engine holds a rank-4 adapter in vLLM's rank-8 buffers (engine.max_lora_rank resolved as a job resolves it),
from the trainer's own adapter layers (trainer/lora.py), zeros as a job's engine starts. Then:
- its layout report (what the sync plans by) lists the adapter's buffers, and no MoE expert carries one;
- greedy answers with the zero adapter (the base's);
- every LoRA buffer is filled with NaN (the stale or fresh pages a level-2 sleep can hand back: on CUDA the weights'
  pages are discarded and come back unwritten; the portable backend keeps these buffers, so the NaN stays unless
  the engine clears it), and the engine answers with it;
- a level-2 sleep and the weights' wake: every LoRA buffer must read zero and vLLM's LoRA mapping cache be
  forgotten, before anything is written;
- the base weights reloaded (as a sync would), the KV cache woken: the answers must be the base's again;
- shut down, the engine leaves none of its workers' /dev/shm entries (vLLM's CPU all-reduce segments) behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os

PROMPTS = [[5, 6, 7, 16], [8, 9, 16], [11, 12, 13, 14, 15]]
GREEDY = {"n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 6}


def trainer_adapter_shapes(model_path: str, rank: int) -> dict[str, tuple[int, ...]]:
    """The adapter a job's trainer builds on this model (all-linear), name -> shape, as the engine receives it."""
    from transformers import AutoModelForCausalLM

    from colocate.trainer.lora import add_lora, lora_targets

    model = AutoModelForCausalLM.from_pretrained(model_path)
    add_lora(model, lora_targets(model, ["all-linear"])["all-linear"], rank=rank, alpha=16, seed=0)
    return {name: tuple(p.shape) for name, p in model.named_parameters() if ".lora_" in name}


def _poison_adapter(worker) -> int:
    """In each worker: every LoRA buffer NaN; returns how many buffers."""
    from colocate.engine.lora import adapter_views

    views = adapter_views(worker)
    for tensor in views.values():
        tensor.fill_(float("nan"))
    return len(views)


def _mapping_cached(worker) -> bool:
    """Whether vLLM would skip rewriting its LoRA metadata for a batch mapped like the last one."""
    return worker.model_runner.lora_manager._adapter_manager._last_mapping is not None


def run(device: str, preset: str, *, tp: int, expert_parallel: bool, rank: int, cache_dir: str) -> dict:
    from safetensors.torch import load_file

    from colocate.config import ModelConfig, load_config
    from colocate.engine.actor import EngineActor
    from colocate.job.resolve import resolve_job
    from colocate.models.sources import ensure_model

    path = ensure_model(ModelConfig(preset=preset, cache_dir=cache_dir))
    shapes = trainer_adapter_shapes(path, rank)
    cfg = resolve_job(load_config(None, [
        f"model.preset={preset}", f"engine.tp={tp}", f"engine.expert_parallel={str(expert_parallel).lower()}",
        f"trainer.lora.rank={rank}", "engine.kv_cache_gib=0.0625", "engine.gpu_memory_utilization=0.3",
        "engine.dtype=float32"]), device=device).config
    engine = EngineActor(cfg.engine, path, device=device, sleep_backend=cfg.engine.sleep_backend, eos_token_id=None,
                         placement_env={"COLOCATE_ENGINE_SLOTS": ",".join(map(str, range(tp)))})
    engine.start(adapter_shapes=shapes)
    try:
        layouts = engine.param_layouts()
        adapter = [[(n, list(shape)) for n, shape, _ in w["params"] if ".lora_" in n] for w in layouts]
        base = engine.generate(PROMPTS, GREEDY)
        num_poisoned = engine.llm.collective_rpc(_poison_adapter)
        poisoned = engine.generate(PROMPTS, GREEDY)
        cached_before = engine.llm.collective_rpc(_mapping_cached)
        engine.sleep(2)
        engine.wake(["weights"])
        woken = engine.state_dicts()
        cached_after = engine.llm.collective_rpc(_mapping_cached)
        engine.load_state(load_file(os.path.join(path, "model.safetensors")))  # the base, as the sync writes it
        engine.wake(["kv_cache"])
        after = engine.generate(PROMPTS, GREEDY)
        worker_entries = sorted(engine._worker_entries)  # vLLM's /dev/shm entries: shutdown must unlink them
    finally:
        engine.shutdown()
    return {
        "max_lora_rank": cfg.engine.max_lora_rank, "trainer_adapter": sorted(shapes),
        "adapter": adapter, "experts": [w["experts"] for w in layouts], "num_poisoned": num_poisoned,
        "nonzero_after_wake": [sorted(n for n, t in w.items() if ".lora_" in n and t.count_nonzero())
                               for w in woken],
        "cached_before": cached_before, "cached_after": cached_after,
        "tokens": {"base": _tokens(base), "poisoned": _tokens(poisoned), "after": _tokens(after)},
        "finite_logprobs": {"poisoned": _finite(poisoned), "after": _finite(after)},
        "worker_entries": worker_entries,
        "entries_left": [n for n in worker_entries if os.path.exists(f"/dev/shm/{n}")],
    }


def _tokens(results: list) -> list:
    return [r[0]["token_ids"] for r in results]


def _finite(results: list) -> bool:
    return all(math.isfinite(lp) for r in results for lp in r[0]["logprobs"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("device")
    parser.add_argument("preset")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--expert-parallel", action="store_true")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args()
    print(json.dumps(run(args.device, args.preset, tp=args.tp, expert_parallel=args.expert_parallel, rank=args.rank,
                         cache_dir=args.cache_dir)))
