"""Placement rules, pure: what each engine asks of Ray and vLLM, the pairing of trainer ranks with the engine
workers on their devices, and which transports a device allows."""

from __future__ import annotations

import pytest

from colocate.config import ConfigError, load_config
from colocate.placement import (ENGINE_SHARE, TRAINER_SHARE, PlacementError, SlotPlan, engine_placement,
                                pair_devices, plan_slots, sync_transport)


@pytest.mark.parametrize("device, tp, engine, bundle, driver_share, bundles", [
    pytest.param("cuda", 2, 1, 2, 0.0, "2,3", id="cuda_tp2_second_engine_driver_holds_no_gpu"),
    pytest.param("cuda", 4, 0, 0, 0.0, "0,1,2,3", id="cuda_tp4"),
    pytest.param("cuda", 1, 3, 3, ENGINE_SHARE, None, id="cuda_tp1_in_process_worker_holds_the_share"),
    pytest.param("cpu", 2, 1, 2, ENGINE_SHARE, None, id="cpu_tp2_mp_executor"),
])
def test_engine_placement(device, tp, engine, bundle, driver_share, bundles):
    where = engine_placement(SlotPlan(device, 4, tp), engine)
    assert where.bundle == bundle and where.driver_share == driver_share
    assert where.env["COLOCATE_ENGINE_SLOTS"] == ",".join(map(str, range(engine * tp, (engine + 1) * tp)))
    assert where.env.get("VLLM_RAY_BUNDLE_INDICES") == bundles
    if bundles:  # each worker's share fits beside the trainer's in its bundle's one GPU
        assert TRAINER_SHARE + float(where.env["VLLM_RAY_PER_WORKER_GPUS"]) <= 1.0


def test_engines_get_disjoint_bundles():
    plan = SlotPlan("cuda", 8, 2)
    indices = [engine_placement(plan, e).env["VLLM_RAY_BUNDLE_INDICES"].split(",") for e in range(4)]
    flat = [i for e in indices for i in e]
    assert sorted(flat, key=int) == [str(i) for i in range(8)]


@pytest.mark.parametrize("trainers, workers, pairs", [
    pytest.param(["a", "b", "c", "d"], [["a", "b"], ["c", "d"]], [(0, 0), (0, 1), (1, 0), (1, 1)], id="tp2x2"),
    # vLLM's V2 workers take GPUs in sorted order, not their bundle's: worker 0 may sit on the second bundle's GPU
    pytest.param(["g1", "g0"], [["g0", "g1"]], [(0, 1), (0, 0)], id="worker_order_differs_from_bundles"),
    pytest.param(["a", "b", "c"], [["a", "b"]], [(0, 0), (0, 1), None], id="rank_without_worker_gathers_only"),
])
def test_pairing_by_device(trainers, workers, pairs):
    assert pair_devices(trainers, workers) == pairs


@pytest.mark.parametrize("trainers, workers, message", [
    pytest.param(["a", "b"], [["a", "c"]], "engine 0 tp worker 1 is on device c, which holds 0 trainer ranks",
                 id="worker_alone_on_its_device"),
    pytest.param(["a", "a"], [["a"]], "holds 2 trainer ranks", id="two_ranks_one_device"),
    pytest.param(["a", "b"], [["a"], ["a"]], "engines must get disjoint devices", id="engines_share_a_device"),
])
def test_pairing_errors_are_one_line(trainers, workers, message):
    with pytest.raises(PlacementError, match=message) as info:
        pair_devices(trainers, workers)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("device, transport, chosen", [
    pytest.param("cpu", "auto", "in_place", id="cpu_auto"),
    pytest.param("cuda", "auto", "gather", id="cuda_auto"),
    pytest.param("cpu", "gather", "gather", id="cpu_gather"),
    pytest.param("cpu", "ring", "ring", id="cpu_ring"),
])
def test_sync_transport(device, transport, chosen):
    assert sync_transport(load_config(None, [f"sync.transport={transport}"]), device) == chosen


@pytest.mark.parametrize("transport", ["in_place", "ring"])
def test_cpu_only_transports_are_refused_on_cuda(transport):
    cfg = load_config(None, [f"sync.transport={transport}", "engine.sleep_backend=vllm"])
    message = f"sync.transport='{transport}' is invalid on a CUDA run.*valid: auto, gather"
    with pytest.raises(ConfigError, match=message):
        plan_slots(cfg, device="cuda", num_devices=8)
