"""The trainer's CUDA path: FSDP2 over NCCL (world size 1 on one GPU), GRPO steps, offload and back through each
backend, and the write of its shards into a ring on the GPU. The body is `train_offload_and_write`
(colocate/bench/gpu_check/trainer.py), which the check's CPU mode runs on gloo in CI.

Each backend frees what it moved where its counter can see it: pinned resizes the storages to 0 (torch's
allocated bytes fall); torch_memory_saver unmaps the pool under torch's feet (torch still counts the blocks as
allocated, the driver's free memory rises). The first GPU run held torch_memory_saver, chosen by
`offload_backend=auto`, against torch's allocated bytes, and failed."""

from __future__ import annotations

import pytest

from colocate.bench.gpu_check.trainer import FREED_FRACTION, train_offload_and_write
from colocate.config import ModelConfig
from tests.distributed.conftest import run_distributed

pytest.importorskip("transformers")


def _train_on_gpu(rank: int, world_size: int, port: int, model_path: str, backend: str):
    got = train_offload_and_write(model_path, device="cuda", backend=backend, port=port)
    assert got["status"] == "pass", got
    assert got["offloader"] == backend and got["bit_exact"] and not got["ring_mismatches"]
    counter = got["allocated_drop"] if backend == "pinned" else got["free_rise"]
    assert counter >= FREED_FRACTION * got["offloaded_bytes"] and got["offloaded_bytes"] >= got["state_bytes"]
    assert got["onloaded_bytes"] == got["offloaded_bytes"]


@pytest.mark.parametrize("backend", ["pinned", "torch_memory_saver"])
def test_fsdp2_nccl_train_offload_and_ring_write(tmp_path, backend):
    if backend == "torch_memory_saver":
        pytest.importorskip("torch_memory_saver")
    from colocate.models.sources import ensure_model

    path = ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path)))
    run_distributed(_train_on_gpu, path, backend, world_size=1, init=False)
