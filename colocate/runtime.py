"""Runtime: bring the co-located actors up on Ray, and take every one of them down again.

    with Runtime(cfg) as rt:        # Ray (local or cluster), placement group, trainers, engines, sync ring
        rt.trainers, rt.engines, rt.sync, rt.tokenizer
    # on exit (normal, exception, Ctrl-C): engines shut down (their TP worker processes exit with them),
    # actors killed, placement group removed, Ray stopped if we started it; no /dev/shm segment stays behind.

Start-up order matters for memory: trainers load and shard first, engines start after (each engine measures
free memory for its KV cache at start), then the ring is opened and sealed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import ray

from colocate.config import JobConfig
from colocate.engine.actor import EngineActor, engine_env
from colocate.models import ensure_model, load_tokenizer
from colocate.placement import (ENGINE_SHARE, TRAINER_SHARE, actor_options, cluster_nodes, create_placement_group,
                                engine_placement, local_device_count, pair_devices, plan_nodes, plan_slots,
                                resolve_device, sleep_backend, sync_transport)
from colocate.preflight import switch_plan
from colocate.sync.transport import remove_orphaned_entries, remove_stale_segments, shm_entries
from colocate.sync.weight_sync import WeightSync
from colocate.trainer.actor import TrainerActor
from colocate.trainer.grpo import LossSettings

log = logging.getLogger("colocate")


class Runtime:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.trainers: list = []
        self.engines: list = []
        self.group = None
        self.slot_nodes: list[str] | None = None  # on a Ray cluster: each slot's node (placement.plan_nodes)
        self.sync: WeightSync | None = None
        self._started_ray = False
        self._shm_before = shm_entries()  # what /dev/shm held before us: close() leaves those alone

    def __enter__(self) -> Runtime:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        cfg = self.cfg
        remove_stale_segments()
        self.device = resolve_device(cfg.placement.device)
        self.model_path = ensure_model(cfg.model)
        try:
            self.tokenizer = load_tokenizer(self.model_path)
        except Exception as e:  # transformers raises many types for a broken or partial model directory
            raise RuntimeError(f"cannot load the tokenizer of model.path={self.model_path!r}: {e}") from None
        self.switch = switch_plan(cfg, device=self.device)  # what must leave the device between phases
        self._init_ray()
        if cfg.placement.ray_address:
            nodes = cluster_nodes(self.device)
            self.plan = plan_slots(cfg, device=self.device, num_devices=sum(nodes.values()), where="the Ray cluster")
            self.slot_nodes = plan_nodes(self.plan, nodes)
        else:
            self.plan = plan_slots(cfg, device=self.device, num_devices=local_device_count(self.device))
        # across nodes only the gather protocol works: every handover stays on the rank's own node
        self.transport = sync_transport(cfg, self.device, multi_node=len(set(self.slot_nodes or ())) > 1)
        self.group = create_placement_group(self.plan, slot_nodes=self.slot_nodes)
        self._start_trainers()
        self._start_engines()
        specs = ray.get(self.trainers[0].param_specs.remote(cfg.engine.dtype))
        from transformers import AutoConfig

        self.sync = WeightSync(self.trainers, self.engines, specs, cfg=cfg.sync,
                               hf_config=AutoConfig.from_pretrained(self.model_path),
                               transport=self.transport, pairs=self.pairs)
        self.sync.open()

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        verbose = self.cfg.logging.level in ("DEBUG", "INFO")
        common = dict(log_to_driver=verbose, logging_level=logging.WARNING,
                      runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(_python_path())}})
        with _sigterm_handler_kept():
            self._connect_ray(common)

    def _connect_ray(self, common: dict) -> None:
        if self.cfg.placement.ray_address:
            ray.init(address=self.cfg.placement.ray_address, **common)
        else:
            # address="local": a new Ray of our own, even when `ray start` left a head running on this machine
            # (plain ray.init() would join that one). A logical CPU per core at least: a slot is a scheduling
            # unit, the cores are shared by design.
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, self.cfg.placement.num_slots),
                     include_dashboard=False, **common)
            self._started_ray = True

    def _start_trainers(self) -> None:
        cfg = self.cfg
        world = self.plan.num_slots
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        env = {"OMP_NUM_THREADS": str(cfg.trainer.num_threads)}
        actor = ray.remote(TrainerActor)
        gpu_share = TRAINER_SHARE if self.device == "cuda" else 0.0
        self.trainers = [
            actor.options(**actor_options(self.group, rank, cpu_share=TRAINER_SHARE, gpu_share=gpu_share,
                                          env=env)).remote(
                rank, world, cfg.trainer, self.model_path, device=self.device, pad_id=pad,
                loss=LossSettings.from_job(cfg))
            for rank in range(world)
        ]
        addr, port = ray.get(self.trainers[0].rendezvous.remote())
        self.trainer_info = ray.get([t.setup.remote(addr, port) for t in self.trainers])

    def _start_engines(self) -> None:
        cfg = self.cfg
        backend = sleep_backend(cfg, self.device)
        actor = ray.remote(EngineActor)
        self.engines = []
        for e in range(self.plan.num_engines):
            where = engine_placement(self.plan, e)
            env = engine_env(cfg.engine, self.device, where.env)
            options = actor_options(self.group, where.bundle, cpu_share=ENGINE_SHARE, env=env,
                                    gpu_share=where.driver_share if self.device == "cuda" else 0.0)
            self.engines.append(actor.options(**options).remote(
                cfg.engine, self.model_path, device=self.device, sleep_backend=backend,
                eos_token_id=self.tokenizer.eos_token_id, placement_env=where.env))
        self.engine_info = ray.get([e.start.remote() for e in self.engines])
        self.pairs = self._pair_trainers_with_workers()

    def _pair_trainers_with_workers(self) -> list[tuple[int, int] | None]:
        """Read back every actor's device and pair each engine worker with the trainer rank beside it; a worker
        with no trainer on its device is a placement error, raised here, before the first sync."""
        trainer_devices = ray.get([t.device_name.remote() for t in self.trainers])
        worker_devices = ray.get([e.device_names.remote() for e in self.engines])
        pairs = pair_devices(trainer_devices, worker_devices)
        self.placement_report = {"trainer_devices": trainer_devices, "engine_worker_devices": worker_devices,
                                 "pairs": pairs, "slot_nodes": self.slot_nodes,
                                 "trainer_nodes": ray.get([t.node_id.remote() for t in self.trainers]),
                                 "engine_nodes": ray.get([e.node_id.remote() for e in self.engines])}
        return pairs

    def restart_engines(self) -> None:
        """Replace every engine with a fresh one (after a crash, or to change engine settings) and rebuild the
        sync plan and rings from the new engines' layout."""
        for engine in self.engines:
            ray.get(engine.shutdown.remote())
            ray.kill(engine, no_restart=True)
        self._start_engines()
        self.sync.engines = self.engines
        self.sync.pairs = self.pairs
        self.sync.open()

    def close(self) -> None:
        """Idempotent teardown; every step tolerates a half-started runtime."""
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception as e:  # a dead engine is what we are cleaning up after
                log.debug("engine shutdown: %s", e)
        for actor in self.engines + self.trainers:
            ray.kill(actor, no_restart=True)
        self.engines, self.trainers = [], []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        remove_stale_segments()
        self._remove_orphaned_segments()

    def _remove_orphaned_segments(self, timeout_s: float = 15) -> None:
        """Killed workers take a moment to exit; until they have, their segments still look mapped."""
        new = shm_entries() - self._shm_before
        deadline = time.monotonic() + timeout_s
        while new and time.monotonic() < deadline:
            new -= set(remove_orphaned_entries(new))
            if new:
                time.sleep(0.5)


@contextlib.contextmanager
def _sigterm_handler_kept():
    """ray.init installs Ray's crash handler for SIGTERM in the driver, which logs and ends the process without
    unwinding: the caller's handler (train.catch_sigterm, which releases actors and segments) is put back."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    yield
    if main and callable(handler):
        signal.signal(signal.SIGTERM, handler)


def _python_path() -> list[str]:
    """Make the actors import this checkout's colocate (and the user's reward modules) like the driver does."""
    import colocate

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(colocate.__file__)))
    return [package_root, os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
