"""The gather protocol as a job runs it: two engines of TP=1 on two slots, `sync.method=gather` (what a GPU
node runs by default), each trainer rank feeding the engine on its own slot. Every engine equals the trainer
bit for bit after every step; the placement report says who feeds whom. The runtime runs in this process, as a
library user's script runs it: its close stops the job's processes, and none of the caller's own (this process's
multiprocessing resource tracker, which an earlier close killed as the job's)."""

from __future__ import annotations

import multiprocessing
from multiprocessing import resource_tracker

import pytest

from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import assert_nothing_left, colocate_processes, shm_segments, small_job

pytestmark = pytest.mark.e2e


def test_two_tp1_engines_fed_by_their_own_ranks(tmp_path):
    lock = multiprocessing.get_context("spawn").Lock()  # a semaphore of the caller's: its tracker is running
    tracker = resource_tracker._resource_tracker._pid
    before = (colocate_processes(), shm_segments())
    cfg = small_job(tmp_path, "engine.tp=1", "placement.num_slots=2", "sync.method=gather",
                    "engine.sleep_level=2", "trainer.offload=true",
                    # engine knobs reach vLLM (a name it did not know would fail the start)
                    "engine.max_num_seqs=8", 'engine.extra_args={"max_logprobs": 5}')
    with Runtime(cfg) as rt:
        assert rt.pairs == [(0, 0), (1, 0)]
        assert rt.placement_report["trainer_devices"] == ["cpu-slot0", "cpu-slot1"]
        assert rt.placement_report["engine_worker_devices"] == [["cpu-slot0"], ["cpu-slot1"]]
        controller = Controller(cfg, rt)
        for step in range(2):
            record = controller.step(step)
            assert record["sync_method"] == "gather"
            assert rt.sync.verify_full(cfg.engine.dtype) == []
    assert_nothing_left(*before)
    assert tracker is not None and resource_tracker._resource_tracker._check_alive(), "the caller's tracker was stopped"
    assert resource_tracker._resource_tracker._pid == tracker
    del lock
