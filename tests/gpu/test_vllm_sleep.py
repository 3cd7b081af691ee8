"""vLLM's sleep mode through colocate's engine actor on one GPU: sleep frees the weights and KV cache (device
memory, as cudaMemGetInfo sees it), wake by tag restores them, generation after wake is identical."""

from __future__ import annotations

import pytest
import torch

from colocate.config import EngineConfig, ModelConfig

pytest.importorskip("vllm")

PROMPTS = [[5, 6, 7, 16], [8, 9, 16]]
SAMPLING = {"n": 2, "temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "seed": 3}


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_and_wake_restores(tmp_path, level):
    from colocate.engine.actor import EngineActor
    from colocate.models.sources import ensure_model

    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path)))
    engine = EngineActor(EngineConfig(tp=1, gpu_memory_utilization=0.3, enforce_eager="false"), path, device="cuda",
                         sleep_backend="vllm",
                         eos_token_id=2)
    engine.start()
    try:
        before = engine.generate(PROMPTS, SAMPLING)
        awake = free_bytes()
        engine.sleep(level)
        reserved = 0.3 * torch.cuda.get_device_properties(0).total_memory
        assert free_bytes() - awake >= 0.8 * reserved  # weights + KV cache handed back
        engine.wake(["weights"])
        if level == 2:  # discarded weights: reload them as a sync would
            from safetensors.torch import load_file

            engine.load_state(load_file(f"{path}/model.safetensors"))
        engine.wake(["kv_cache"])
        assert engine.generate(PROMPTS, SAMPLING) == before
    finally:
        engine.shutdown()
