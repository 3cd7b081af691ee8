"""GPU placement on this CPU machine: Ray is told there are 4 GPUs (it then assigns GPU ids and sets
CUDA_VISIBLE_DEVICES exactly as on a GPU node), and colocate's placement group and actor options are used as the
runtime uses them. The engine's TP workers are placed the way vLLM 0.32's Ray executor places them (read from
`vllm/v1/executor/ray_executor_v2.py`: `VLLM_RAY_BUNDLE_INDICES` through vLLM's own `get_bundles_for_indices`,
`VLLM_RAY_PER_WORKER_GPUS` GPUs per worker, no CUDA_VISIBLE_DEVICES narrowing, worker i on the i-th smallest
GPU id of the engine). The probes stand in for the actors only where their device is asked: vLLM's CPU build
has no Ray executor, and no GPU is here to start one on.

Also, with fakes at the actor boundary (allowed: what is tested is the sync's Ray graph, not the actors), the
late-load race: a slot is never rewritten before the engine's load of it returned."""

from __future__ import annotations

import os
import time

import pytest
import ray

from colocate.job.placement import (
    ENGINE_SHARE,
    TRAINER_SHARE,
    SlotPlan,
    actor_options,
    create_placement_group,
    engine_placement,
    pair_devices,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def declared_gpus():
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))])}})
    yield
    ray.shutdown()


@ray.remote
class TrainerProbe:
    def gpu(self) -> str:
        visible = os.environ["CUDA_VISIBLE_DEVICES"]  # what torch would see: Ray narrows it to the bundle's GPU
        assert ray.get_runtime_context().get_accelerator_ids()["GPU"] == [visible]
        return visible


@ray.remote
class WorkerProbe:
    def gpus(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids()["GPU"]


@ray.remote
class EngineDriverProbe:
    """Starts its engine's workers as vLLM's Ray executor V2 would, from the environment colocate gives it."""

    def worker_devices(self, tp: int, place_timeout_s: float = 300) -> list[str]:
        if tp == 1:  # no executor: the engine actor is the worker, on the GPU share it asked for itself
            return ray.get_runtime_context().get_accelerator_ids()["GPU"]
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from vllm.v1.executor.ray_utils import get_bundles_for_indices

        group = ray.util.get_current_placement_group()  # what vLLM reuses (initialize_ray_cluster)
        indices = [int(i) for i in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        share = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
        workers = [WorkerProbe.options(
            num_cpus=0, num_gpus=share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                 placement_group_bundle_index=bundle),
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}).remote()
            for bundle, _, _ in get_bundles_for_indices(group, indices, tp)]
        # a probe that cannot be placed waits forever; one that can starts in seconds alone, but minutes on a
        # loaded 2-core machine (a Ray worker process each): the bound only has to tell the two apart
        ready, _ = ray.wait([w.gpus.remote() for w in workers], num_returns=len(workers),
                            timeout=place_timeout_s)
        assert len(ready) == tp, f"vLLM's workers could not be placed (bundles {indices}, {share} GPU each)"
        ids = sorted(int(g) for w in ray.get(ready) for g in w)
        # V2: local rank i -> the i-th smallest physical id among the engine's workers on the node
        return [str(ids[i]) for i in range(tp)]


@pytest.mark.parametrize("tp", [pytest.param(2, id="tp2_two_engines"), pytest.param(1, id="tp1_four_engines")])
def test_every_trainer_rank_shares_its_gpu_with_the_worker_it_feeds(declared_gpus, tp):
    plan = SlotPlan("cuda", 4, tp)
    group = create_placement_group(plan, timeout_s=30)
    try:
        trainers = [TrainerProbe.options(**actor_options(group, r, cpu_share=TRAINER_SHARE,
                                                         gpu_share=TRAINER_SHARE)).remote() for r in range(4)]
        placements = [engine_placement(plan, e) for e in range(plan.num_engines)]
        drivers = [EngineDriverProbe.options(**actor_options(group, where.bundle, cpu_share=ENGINE_SHARE,
                                                             gpu_share=where.driver_share, env=where.env)).remote()
                   for where in placements]
        trainer_gpus = ray.get([t.gpu.remote() for t in trainers], timeout=300)
        # each driver imports vLLM's Ray utilities and starts its workers' processes: over 120 s was seen with a
        # second suite and a busy loop beside this one (issue 19's loaded runs)
        worker_gpus = ray.get([d.worker_devices.remote(tp) for d in drivers], timeout=600)

        assert sorted(trainer_gpus) == ["0", "1", "2", "3"]  # one rank per GPU
        engine_gpus = [set(w) for w in worker_gpus]
        assert all(len(g) == tp for g in engine_gpus) and len(set().union(*engine_gpus)) == 4  # disjoint
        pairs = pair_devices(trainer_gpus, worker_gpus)
        for rank, (engine, tp_rank) in enumerate(pairs):
            assert worker_gpus[engine][tp_rank] == trainer_gpus[rank]
            assert rank in range(engine * tp, (engine + 1) * tp)  # the engine's own bundles
    finally:
        ray.util.remove_placement_group(group)


def test_without_bundle_indices_and_shares_vllm_workers_cannot_be_placed(declared_gpus):
    """What the review predicted for the old placement: the TP>1 engine driver held half a GPU and vLLM's workers
    asked a whole one each (VLLM_RAY_PER_WORKER_GPUS defaults to 1.0) in bundles where trainers hold half."""
    plan = SlotPlan("cuda", 4, 2)
    group = create_placement_group(plan, timeout_s=30)
    try:
        [TrainerProbe.options(**actor_options(group, r, cpu_share=TRAINER_SHARE, gpu_share=TRAINER_SHARE)).remote()
         for r in range(4)]
        old_env = {"VLLM_RAY_BUNDLE_INDICES": "0,1"}  # even given its bundles, 1.0 GPU per worker cannot fit
        driver = EngineDriverProbe.options(**actor_options(group, 0, cpu_share=ENGINE_SHARE, gpu_share=ENGINE_SHARE,
                                                           env=old_env)).remote()
        with pytest.raises(ray.exceptions.RayTaskError, match="could not be placed"):
            # the workers can never be placed: 30 s tells it (the others are given minutes to start)
            ray.get(driver.worker_devices.remote(2, place_timeout_s=30), timeout=600)
    finally:
        ray.util.remove_placement_group(group)


# ------------------------------------------------------------------------------------------ late-load race


@ray.remote
class FakeTrainer:
    """The trainer's side of the gather protocol at the actor boundary: waits for the load it is given, as
    TrainerActor.gather_write does, and logs when it gathered and when it would have written."""

    def __init__(self):
        self.log = []

    def gather_write(self, key, index, after):
        failed = None
        try:
            ray.get(after)
        except Exception as e:
            failed = e
        started = time.monotonic()
        time.sleep(0.01)  # the gather every rank takes part in, failed load or not
        self.log.append((index, started, time.monotonic(), failed is None))
        if failed is not None:
            raise failed
        return [(0, 0, 0, 0)]

    def take_log(self):
        return self.log


@ray.remote
class FakeEngine:
    def __init__(self, fail_at: int | None = None):
        self.log, self.fail_at = [], fail_at

    def load_bucket(self, key, index, *writes):
        started = time.monotonic()
        time.sleep(0.5 if index % 3 == 0 else 0.02)  # some loads finish late
        self.log.append((index, started, time.monotonic()))
        if index == self.fail_at:
            raise RuntimeError(f"checksum mismatch in bucket {index}")
        return {"verify_s": 0.0, "load_s": 0.0}

    def finish_sync(self):
        return 0.0

    def take_log(self):
        return self.log


def _fake_sync(engines, pairs):
    from types import SimpleNamespace

    from colocate.config import SyncConfig
    from colocate.sync.weight_sync import WeightSync

    trainers = [FakeTrainer.remote() for _ in pairs]
    sync = WeightSync(trainers, engines, [], cfg=SyncConfig(), hf_config=None, method="gather", pairs=pairs)
    sync.plan = SimpleNamespace(buckets=list(range(8)), num_slots=2, in_place=False, num_bytes=0, mode="sliced")
    return sync, trainers


def test_a_late_load_never_has_its_slot_rewritten(declared_gpus):
    engines = [FakeEngine.remote() for _ in range(2)]
    pairs = [(0, 0), (1, 0), None]  # rank 2 has no worker beside it: it only gathers
    sync, trainers = _fake_sync(engines, pairs)
    sync.run()
    loads = [{i: (s, e) for i, s, e in ray.get(engine.take_log.remote())} for engine in engines]
    for trainer, pair in zip(trainers, pairs):
        for index, started, _, _ in ray.get(trainer.take_log.remote()):
            if pair is not None and index >= 2:  # slot index % 2 was last loaded by bucket index - 2
                assert started >= loads[pair[0]][index - 2][1], (pair, index)


def test_a_failed_load_fails_the_sync_but_every_rank_still_gathers(declared_gpus):
    """One engine's load fails: its feeder writes nothing after it, yet takes part in every later all-gather,
    so the trainers' process group stays in step; the sync raises the engine's error."""
    engines = [FakeEngine.remote(fail_at=2), FakeEngine.remote()]
    sync, trainers = _fake_sync(engines, [(0, 0), (1, 0)])
    with pytest.raises(ray.exceptions.RayTaskError, match="checksum mismatch in bucket 2"):
        sync.run()
    logs = [ray.get(t.take_log.remote()) for t in trainers]
    assert all(sorted(i for i, *_ in log) == list(range(8)) for log in logs)  # every rank, every gather
    assert [i for i, _, _, wrote in logs[0] if not wrote] == [4, 6]  # slot of bucket 2 never freed again
