"""A MoE model (the embedded tiny-moe: 8 experts, top-2) trained and synced on the real stack with expert
parallelism: each of the engine's two TP workers holds 4 whole experts (vLLM's expert map), FSDP2 shards the
trainer's fused expert tensors by expert, and the gather protocol (the CUDA path, on gloo and shared memory)
reshards them into each worker's block. Every step's sync is compared in full with the trainer, through the
independent layout oracle, with the engine's sleep level 2 (weights discarded while training: only the sync puts
them back). The same model at TP=2 without expert parallelism (each expert's intermediate dimension split) runs
as the policy of the reward-model e2e job (tests/e2e/test_reward_model.py), which shares its engine start."""

from __future__ import annotations

import pytest
import ray

from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import small_job

pytestmark = pytest.mark.e2e

EXPERTS = "model.layers.0.mlp.experts.routed_experts"


def test_expert_parallel_engine_is_synced_exactly_through_the_gather(tmp_path):
    cfg = small_job(tmp_path, "model.preset=tiny-moe", "engine.expert_parallel=true", "sync.method=gather",
                    "sync.verify=full", "algo.num_steps=3")
    with Runtime(cfg) as rt:
        layouts = ray.get(rt.engines[0].param_layouts.remote())
        # vLLM's expert map as each worker reports it: two blocks of four whole experts
        assert [w["experts"] for w in layouts] == [
            {"tp_rank": 0, "tp_size": 1, "expert_ids": [0, 1, 2, 3]},
            {"tp_rank": 0, "tp_size": 1, "expert_ids": [4, 5, 6, 7]}]
        shapes = {name: shape for name, shape, _ in layouts[0]["params"]}
        assert shapes[f"{EXPERTS}.w13_weight"] == (4, 128, 128) and shapes[f"{EXPERTS}.w2_weight"] == (4, 128, 64)
        assert rt.sync.plan.mode == "sliced"  # the experts have a rule: no full-tensor fallback
        # EP without TP: one piece per expert tensor and worker (its four experts are one block in both tensors)
        for worker in rt.sync.plan.pieces:
            assert len(worker[f"{EXPERTS}.w13_weight"]) == 1 and len(worker[f"{EXPERTS}.w2_weight"]) == 1
        controller = Controller(cfg, rt)
        for step in range(3):
            record = controller.step(step)  # sync.verify=full raises on any mismatch
            assert record["sync_mode"] == "sliced" and record["sync_method"] == "gather"
            # one call into the engine per bucket (pre, 2 layers, post) and the post-load step, not per expert
            assert record["sync_round_trips"] == len(rt.sync.plan.buckets) + 1 == 5
        assert rt.sync.verify_full(cfg.engine.dtype) == []
