"""Placement rules, pure: what each engine asks of Ray and vLLM, the pairing of trainer ranks with the engine
workers on their devices, and which sync methods a device allows."""

from __future__ import annotations

import pytest

from colocate.config import load_config
from colocate.errors import ConfigError, PlacementError
from colocate.job.placement import (
    ENGINE_SHARE,
    TRAINER_SHARE,
    SlotPlan,
    engine_placement,
    pair_devices,
    plan_nodes,
    plan_slots,
    sync_method,
)


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


@pytest.mark.parametrize("device, method, chosen", [
    pytest.param("cpu", "auto", "in_place", id="cpu_auto"),
    pytest.param("cuda", "auto", "gather", id="cuda_auto"),
    pytest.param("cpu", "gather", "gather", id="cpu_gather"),
    pytest.param("cpu", "ring", "ring", id="cpu_ring"),
])
def test_sync_method(device, method, chosen):
    assert sync_method(load_config(None, [f"sync.method={method}"]), device) == chosen


@pytest.mark.parametrize("method", ["in_place", "ring"])
def test_cpu_only_methods_are_refused_on_cuda(method):
    cfg = load_config(None, [f"sync.method={method}", "engine.sleep_backend=vllm"])
    message = f"sync.method='{method}' is invalid on a CUDA run.*valid: auto, gather"
    with pytest.raises(ConfigError, match=message):
        plan_slots(cfg, device="cuda", num_devices=8)


@pytest.mark.parametrize("device, num_slots, tp, nodes, expected", [
    pytest.param("cuda", 16, 2, {"b": 8, "a": 8}, ["a"] * 8 + ["b"] * 8, id="two_8gpu_nodes"),
    pytest.param("cuda", 4, 2, {"b": 8, "a": 8}, ["a"] * 4, id="packs_onto_one_node"),
    pytest.param("cpu", 2, 1, {"n1": 1, "n0": 1}, ["n0", "n1"], id="one_slot_per_node"),
    # 6 GPUs + 2 GPUs at TP=4: the 6-GPU node holds one engine, the 2-GPU node none
    pytest.param("cuda", 4, 4, {"big": 6, "small": 2}, ["big"] * 4, id="uneven_nodes"),
])
def test_every_engine_lies_within_one_node(device, num_slots, tp, nodes, expected):
    slot_nodes = plan_nodes(SlotPlan(device, num_slots, tp), nodes)
    assert slot_nodes == expected
    for engine in range(num_slots // tp):
        assert len(set(slot_nodes[engine * tp:(engine + 1) * tp])) == 1


@pytest.mark.parametrize("num_slots, tp, nodes, message", [
    pytest.param(2, 2, {"n0": 1, "n1": 1}, r"engine.tp=2 is invalid on this Ray cluster: .* largest node has 1 CPU "
                 r"cores .*valid: engine.tp <= 1", id="tp_larger_than_every_node"),
    # 12 cores in total, as 12 slots need, but a TP=4 engine cannot straddle the two 6-core nodes
    pytest.param(12, 4, {"n0": 6, "n1": 6}, r"placement.num_slots=12 is invalid on this Ray cluster: its 3 "
                 r"engine\(s\) of engine.tp=4 need 4 CPU cores each within one node.* hold 2; valid: "
                 r"placement.num_slots <= 8", id="enough_devices_in_total_but_not_per_node"),
])
def test_a_cluster_of_the_wrong_shape_is_refused_in_one_line(num_slots, tp, nodes, message):
    with pytest.raises(ConfigError, match=message) as info:
        plan_nodes(SlotPlan("cpu", num_slots, tp), nodes)
    assert "\n" not in str(info.value)


def test_across_nodes_the_sync_gathers():
    assert sync_method(load_config(None, []), "cpu", multi_node=True) == "gather"
    with pytest.raises(ConfigError, match="sync.method='in_place' is invalid for a job across several nodes"):
        sync_method(load_config(None, ["sync.method=in_place"]), "cpu", multi_node=True)


def test_split_placement_gives_trainers_the_first_slots_and_engines_the_rest():
    plan = plan_slots(load_config(None, ["placement.num_slots=4", "placement.engine_slots=2", "engine.tp=2"]),
                      device="cuda", num_devices=4)
    assert (plan.split, plan.num_trainer_ranks, plan.num_engines, plan.engine_slots(0)) == (True, 2, 1, [2, 3])
    assert plan.describe()[1:] == ["  slot 0: trainer rank 0", "  slot 1: trainer rank 1",
                                   "  slot 2: engine 0 tp worker 0", "  slot 3: engine 0 tp worker 1"]
    where = engine_placement(plan, 0)  # vLLM's Ray executor puts the workers in the engines' own bundles
    assert where.bundle == 2 and where.env["VLLM_RAY_BUNDLE_INDICES"] == "2,3"
    two = plan_slots(load_config(None, ["placement.num_slots=3", "placement.engine_slots=2", "engine.tp=1"]),
                     device="cpu", num_devices=3)
    assert (two.num_trainer_ranks, two.num_engines, two.engine_slots(1)) == (1, 2, [2])
    assert sync_method(load_config(None, ["placement.num_slots=3", "placement.engine_slots=2", "engine.tp=1"]),
                          "cpu") == "broadcast"


def test_split_placement_across_nodes_keeps_engines_whole_and_trainers_on_what_is_left():
    plan = plan_slots(load_config(None, ["placement.num_slots=6", "placement.engine_slots=4", "engine.tp=2"]),
                      device="cuda", num_devices=6)
    # engines fill the largest node first; the trainer ranks take the devices left, in the same order
    assert plan_nodes(plan, {"a": 4, "b": 2}) == ["b", "b", "a", "a", "a", "a"]
    assert plan_nodes(plan, {"a": 3, "b": 3}) == ["a", "b", "a", "a", "b", "b"]
    with pytest.raises(ConfigError, match=r"^placement.engine_slots=4 is invalid on this Ray cluster: .* valid: "
                                          r"placement.engine_slots <= 2$"):
        plan_nodes(plan, {"a": 3, "b": 1, "c": 1})


@pytest.mark.parametrize("overrides, message", [
    (["placement.num_slots=3", "placement.engine_slots=3"],
     "placement.engine_slots=3 is invalid: a split placement leaves at least one of placement.num_slots=3 to the "
     "trainers; valid: 0 (co-located) or 1..2 (a multiple of engine.tp=2), e.g. placement.engine_slots=2"),
    (["placement.num_slots=4", "placement.engine_slots=3", "engine.tp=2"],
     "placement.engine_slots=3 is invalid: holds whole engines of engine.tp=2 workers each; valid: a multiple of 2 "
     "below placement.num_slots=4, e.g. placement.engine_slots=2"),
    (["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1", "sync.method=in_place"],
     "sync.method='in_place' is invalid: a split placement's engines share no device with a trainer, so the sync "
     "is broadcast to them over a process group; valid with placement.engine_slots > 0: auto, broadcast"),
    (["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1", "engine.sleep_level=2"],
     "engine.sleep_level='2' is invalid: a split placement's engines have their devices to themselves, so they never "
     "sleep; valid with placement.engine_slots > 0: auto or 0"),
    (["placement.num_slots=2", "placement.engine_slots=1", "engine.tp=1", "trainer.offload=true"],
     "trainer.offload='true' is invalid: a split placement's trainers have their devices to themselves, so their "
     "state stays; valid with placement.engine_slots > 0: auto or false"),
    (["sync.method=broadcast"],
     "sync.method='broadcast' is invalid: is the split placement's sync (placement.engine_slots > 0); valid "
     "co-located: auto, gather, in_place, ring"),
])
def test_a_bad_split_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides)
    assert str(raised.value) == message
