"""Fused expert tensors through both trainer-side writers, on gloo with FSDP2 over 2 ranks: the direct write
(each rank its own experts' rows into every worker's ring, the CPU's ring and in-place path) and the gather
protocol (each layer all-gathered, each rank feeding only the worker on its own device, the CUDA path). 7 experts
shard 4/3 by FSDP2 (dim 0), and engine TP=2 (each expert's intermediate split) or EP=2 (4/3 whole experts per
worker, vLLM's block) cut across those shards. Each worker loads with the production loader and must hold, bit
for bit, what the layout oracle computes from the full tensors."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.buffers import ShmBuffer, ShmHandle
from tests.distributed.conftest import run_distributed
from tests.distributed.test_shards import _sharded
from tests.unit.test_reshard import HD, NKV, NQ
from tests.unit.test_reshard_experts import VOCAB, moe_engine_shapes, moe_state

NUM_EXPERTS = 7  # uneven: FSDP2 gives rank 0 experts 0-3 and rank 1 experts 4-6


def _state() -> dict[str, torch.Tensor]:
    full = moe_state(num_layers=2)
    for name in list(full):
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            full[name] = full[name][:NUM_EXPERTS].clone()
    return full


def _layouts(full, expert_parallel: bool) -> list[dict]:
    from colocate.sync.tp_layout import ExpertLayout, TPLayout

    layouts = []
    for rank in range(2):
        if expert_parallel:
            ids = list(range(4)) if rank == 0 else list(range(4, NUM_EXPERTS))
            experts = {"tp_rank": 0, "tp_size": 1, "expert_ids": ids}
        else:
            experts = {"tp_rank": rank, "tp_size": 2, "expert_ids": list(range(NUM_EXPERTS))}
        layout = TPLayout(rank, 2, NQ, NKV, HD, VOCAB, ExpertLayout(experts["tp_rank"], experts["tp_size"],
                                                                     tuple(experts["expert_ids"])))
        layouts.append({"tp_rank": rank, "tp_size": 2, "experts": experts, "layout": layout,
                        "params": [(n, s, "bf16") for n, s in moe_engine_shapes(full, layout)]})
    return layouts


def _plan(full, layouts):
    from colocate.sync.buckets import TensorSpec
    from colocate.sync.reshard import build_sync_plan
    from colocate.sync.tp_layout import TPLayout

    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in full.items()]
    plan = build_sync_plan(specs, [{k: v for k, v in w.items() if k != "layout"} for w in layouts],
                           lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB), bucket_bytes=0, num_slots=2)
    assert plan.mode == "sliced"
    return plan, specs


def _sync_rank(rank: int, world_size: int, handles: list[ShmHandle], expert_parallel: bool, gather: bool):
    import torch.distributed as dist

    from colocate.sync.gather import GatherWriter, plan_gather
    from colocate.sync.load import verify_then_load
    from colocate.sync.shards import local_shards, write_bucket
    from colocate.sync.tp_layout import engine_tensor
    from colocate.sync.buffers import attach

    full = _state()
    params, _ = _sharded(full, world_size)
    layouts = _layouts(full, expert_parallel)
    plan, specs = _plan(full, layouts)
    rings = [attach(h) for h in handles]
    engines = [{n: torch.zeros(s, dtype=torch.bfloat16) for n, s, _ in w["params"]} for w in layouts]
    with torch.no_grad():  # "trained": the sync must carry the new values, not the ones the state started with
        for p in params.values():
            p.to_local().mul_(-1.5)
    shards = local_shards(params)
    if gather:  # rank r feeds worker r (as on one GPU), and loads it itself
        writer = GatherWriter(plan, plan_gather(plan, specs, world_size=world_size), rank=rank,
                              world_size=world_size, device=torch.device("cpu"), targets=[(rank, rings[rank])])
        for index in range(len(plan.buckets)):
            written = writer.write(index, shards)
            _, _, error = verify_then_load(plan, index, rings[rank], written, worker=rank, params=engines[rank])
            assert error is None, error
        loaded = [rank]
    else:  # every rank writes its own rows into both workers' rings; after a barrier each worker loads
        for index in range(len(plan.buckets)):
            written = write_bucket(plan, index, shards, rings)
            dist.barrier()
            if rank == 0:
                for worker in range(2):
                    mine = [c for c in written if c[0] == worker]
                    _, _, error = verify_then_load(plan, index, rings[worker], mine, worker=worker,
                                                   params=engines[worker])
                    assert error is None, error
            dist.barrier()
        loaded = [0, 1] if rank == 0 else []
    current = {n: p.full_tensor().to(torch.bfloat16) for n, p in params.items()}
    for worker in loaded:
        for name, tensor in engines[worker].items():
            expected = engine_tensor(name, current, layouts[worker]["layout"])
            assert torch.equal(tensor[: expected.shape[0]], expected), (worker, name)


@pytest.mark.parametrize("gather", [False, True], ids=["direct", "gather"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_experts_reach_each_worker_exactly_across_uneven_expert_shards(expert_parallel, gather):
    full = _state()
    plan, _ = _plan(full, _layouts(full, expert_parallel))
    owners = [ShmBuffer.create(plan.ring_bytes, tag="test") for _ in range(2)]  # one ring per worker
    try:
        run_distributed(_sync_rank, [o.handle for o in owners], expert_parallel, gather)
    finally:
        for owner in owners:
            owner.unlink()
