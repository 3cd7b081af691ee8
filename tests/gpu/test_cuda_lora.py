"""A LoRA engine of a MoE model under vLLM's own sleep mode on one GPU: a level-2 sleep discards the weights' pool,
LoRA buffers and LoRA metadata included, and wake maps fresh pages (vLLM's cumem allocator, zeroed on ROCm only).
The same calls as the CPU's e2e check (tests/e2e/lora_engine.py, run by tests/e2e/test_lora.py): only the trainer's
projections carry buffers (the experts keep their Triton kernel), and after the wake every LoRA buffer reads zero,
the mapping cache is forgotten, and the answers are the base's again."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_a_level_2_wake_leaves_no_stale_lora_page(tmp_path):
    from tests.e2e.lora_engine import run

    r = run("cuda", "tiny-moe", tp=1, expert_parallel=False, rank=4, cache_dir=str(tmp_path))
    assert r["max_lora_rank"] == 8
    [worker] = r["adapter"]
    assert sorted(name for name, _ in worker) == r["trainer_adapter"]  # no expert wrapped
    assert r["num_poisoned"] == [16] and not r["finite_logprobs"]["poisoned"]
    assert r["cached_before"] == [True] and r["cached_after"] == [False]
    assert r["nonzero_after_wake"] == [[]]
    assert r["tokens"]["after"] == r["tokens"]["base"] and r["finite_logprobs"]["after"]
