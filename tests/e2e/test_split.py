"""Split placement as a user launches it: the trainers on slots of their own, the engines on the others, nothing
asleep, every sync broadcast from the trainers to the engines' workers over gloo groups (sync/broadcast.py).
A Ray cluster is told of 4 CPU slots (this machine has 2 cores: the layout, not the speed, is what is tested) and
`colocate launch` joins it, in a process of its own. `sync.verify=full` compares every engine tensor with the
trainers' after each sync and fails the job on any difference: steps done are exact syncs. One engine of TP=2 fed
by one trainer rank (it feeds both TP ranks), and two engines of TP=1 fed by one broadcast from two trainer ranks
(rank 1 gathers only)."""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.conftest import assert_nothing_left, colocate_processes, launch, shm_segments

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def four_slots():
    from ray.cluster_utils import Cluster

    before = (colocate_processes(), shm_segments())
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the head's, and the launched job's (it inherits it)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        if cluster is not None:
            cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
    assert_nothing_left(*before)


@pytest.mark.parametrize("num_slots, tp, trainer_devices, worker_devices", [
    pytest.param(3, 2, ["cpu-slot0"], [["cpu-slot1", "cpu-slot2"]], id="one_rank_feeds_a_tp2_engine"),
    pytest.param(4, 1, ["cpu-slot0", "cpu-slot1"], [["cpu-slot2"], ["cpu-slot3"]], id="one_broadcast_two_engines"),
])
def test_split_sync_is_bit_exact_after_every_step(four_slots, tmp_path, num_slots, tp, trainer_devices,
                                                  worker_devices):
    result = launch(tmp_path, f"placement.ray_address={four_slots}", f"placement.num_slots={num_slots}",
                    "placement.engine_slots=2", f"engine.tp={tp}", "sync.verify=full", "algo.num_steps=2",
                    "logging.progress=false", "checkpoint.at_end=false")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    startup = next(r for r in records if r.get("event") == "startup")
    assert startup["sync_method"] == "broadcast" and startup["sync_mode"] == "sliced"
    assert startup["switch"]["engine_sleep_level"] == 0 and not startup["switch"]["trainer_offload"]
    placement = startup["placement"]
    assert placement["trainer_devices"] == trainer_devices and placement["engine_worker_devices"] == worker_devices
    assert placement["pairs"] == [None] * len(trainer_devices)
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["sync_method"] == "broadcast" for r in steps)
