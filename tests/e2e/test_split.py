"""Split placement as a job runs it: the trainers on slots of their own, the engines on the others, nothing
asleep, every sync broadcast from the trainers to the engines' workers over gloo groups (sync/broadcast.py).
Ray is told of 4 CPU slots (this machine has 2 cores: the layout, not the speed, is what is tested). After every
step every engine worker equals the trainer bit for bit: one engine of TP=2 fed by one trainer rank (it feeds
both TP ranks), and two engines of TP=1 fed by one broadcast from two trainer ranks (rank 1 gathers only)."""

from __future__ import annotations

import os

import pytest

from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import assert_nothing_left, colocate_processes, shm_segments, small_job

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def four_slots():
    from ray.cluster_utils import Cluster

    before = (colocate_processes(), shm_segments())
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as tests/e2e/test_multinode.py: this process's Ray reads it once
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        import ray

        ray.shutdown()  # the runtimes joined the cluster and left their driver connected: Ray's own Cluster
        if cluster is not None:  # refuses to stop a node this process is connected to
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
    cfg = small_job(tmp_path, f"placement.ray_address={four_slots}", f"placement.num_slots={num_slots}",
                    "placement.engine_slots=2", f"engine.tp={tp}", "engine.sleep_level=auto", "trainer.offload=auto")
    with Runtime(cfg) as rt:
        assert rt.switch.engine_sleep_level == 0 and not rt.switch.trainer_offload  # nothing shares a device
        report = rt.placement_report
        assert report["trainer_devices"] == trainer_devices and report["engine_worker_devices"] == worker_devices
        assert rt.pairs == [None] * len(trainer_devices)
        controller = Controller(cfg, rt)
        for step in range(2):
            record = controller.step(step)
            assert record["sync_transport"] == "broadcast" and record["sync_mode"] == "sliced"
            assert rt.sync.verify_full(cfg.engine.dtype) == []
