"""Runtime: bring the co-located actors up on Ray, and take every one of them down again.

    with Runtime(cfg, setup) as rt: # Ray (local or cluster), placement group, trainers, engines, sync ring
        rt.trainers, rt.engines, rt.sync, rt.tokenizer, rt.setup.task
    # on exit (normal, exception, Ctrl-C): engines shut down (their TP worker processes exit with them),
    # actors killed, placement group removed, Ray stopped if we started it; no /dev/shm segment stays behind.

Each runtime is one job with a random token (`self.job`): its segments' names, its Ray namespace
(`colocate-<job>`) and its actors' names carry it, and <logging.output_dir>/job.json records what it started, so
`colocate clean` can remove what a SIGKILLed controller left and nothing else (colocate/host/clean.py). This
module starts the actors; the Ray they run on is job/ray_session.py's (its own listens on loopback only, as does
the trainers' TCPStore when they share one node: docs/security.md), and the job's footprint on this host, recorded
and taken away, job/teardown.py's.

Start-up order matters for memory: trainers load and shard first, engines start after (each engine measures
free memory for its KV cache at start), then the ring is opened and sealed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import ray

from colocate.config import JobConfig
from colocate.config.critic import resolved_critic
from colocate.config.reward_model import reward_models_in
from colocate.engine.actor import CONCURRENCY_GROUPS, EngineActor, engine_env, speculative_config
from colocate.engine.reward_engine import RewardEngineActor, reward_engine_config
from colocate.host.shm import JOB_ENV, new_job_token
from colocate.job.groups import EngineGroup, TrainerGroup
from colocate.job.placement import (
    TRAINER_SHARE,
    actor_options,
    cluster_nodes,
    create_placement_group,
    engine_placement,
    pair_devices,
    plan_nodes,
    plan_slots,
    resolve_device,
    reward_model_placement,
)
from colocate.job.preflight import plan_switch
from colocate.job.ray_session import LOOPBACK, connect_ray, ray_record
from colocate.job.resolve import ResolvedJob, resolve_job
from colocate.job.setup import JobSetup, bare_setup
from colocate.job.teardown import JobFootprint, stop_actors
from colocate.models.sources import ensure_reward_model
from colocate.rollout.reward_model import RewardModel
from colocate.sync.buckets import TensorSpec
from colocate.sync.tp_layout import is_adapter
from colocate.sync.weight_sync import WeightSync
from colocate.trainer.actor import TrainerActor

log = logging.getLogger("colocate")

# Trainers on one node: gloo on loopback, every rank a client of the store rank 0's actor hosts on loopback
# (TrainerActor.rendezvous). GLOO_SOCKET_IFNAME: else gloo listens on the address the hostname resolves to.
ONE_NODE_TRAINER_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo"}


class Runtime:
    def __init__(self, cfg: JobConfig, setup: JobSetup | None = None):
        """`setup`: what run_job built once (job/setup.py: the model, its tokenizer, the task, the slots, every
        "auto" decided); without it (a test, a benchmark) start() builds it, unchecked. On a Ray cluster the slots
        are planned and the autos decided once the nodes are known."""
        self.cfg = cfg
        self.setup = setup
        self.resolved: ResolvedJob | None = None
        self.trainers = TrainerGroup()
        self.engines = EngineGroup()
        self.group = None
        self.slot_nodes: list[str] | None = None  # on a Ray cluster: each slot's node (placement.plan_nodes)
        self.sync: WeightSync | None = None
        self.reward_model: RewardModel | None = None  # rollout.rewards=model:PATH or judge:PATH: its engine
        self.reward_model_info: dict | None = None  # where it runs and its start-up figures
        self.env_workers: list = []  # rollout.env_workers: the actors holding the environments (rollout/env_workers.py)
        self._started_ray = False
        self.job = new_job_token()
        self.namespace = f"colocate-{self.job}"
        self.footprint = JobFootprint(cfg.logging.output_dir, self.job)  # job.json, and what close() removes
        self._engines_prepared: list = []  # the engines' prepare() calls in flight
        self._adapter_shapes: dict | None = None  # a LoRA job's adapter ({} otherwise), asked of the trainers once
        self._engine_generation = 0  # actor names must be new: a killed actor's name is freed asynchronously
        self._engine_names: list[str] = []  # each engine's actor name (a replaced engine's is new)

    def __enter__(self) -> Runtime:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # after a failure an engine may be stuck behind a dead or stopped worker: do not wait a minute on it
        self.close(engine_timeout_s=60 if exc_type is None or exc_type is KeyboardInterrupt else 10)

    def start(self) -> None:
        cfg = self.cfg
        self.footprint.begin()  # before anything that could leave something behind
        if self.setup is None:  # decided before Ray takes its share of the memory the switch plan measures
            self.setup = bare_setup(cfg)
            self.cfg = cfg = self.setup.config  # placement.engine_slots=auto decided there
        setup = self.setup
        self.model_path, self.tokenizer = setup.model_path, setup.tokenizer
        if not cfg.placement.ray_address:
            assert setup.resolved is not None and setup.slots is not None, "a local job's set-up plans its slots"
            self._resolve(setup.resolved)
            self.plan = setup.slots
        self._init_ray()
        self.footprint.record.update(ray=self._ray_record())
        if cfg.placement.ray_address:
            device = resolve_device(cfg.placement.device)
            nodes = cluster_nodes(device)
            self.plan = plan_slots(cfg, device=device, num_devices=sum(nodes.values()), where="the Ray cluster")
            self.slot_nodes = plan_nodes(self.plan, nodes)
            # across nodes only the gather protocol works: every handover stays on the rank's own node
            switch = setup.resolved.switch if setup.resolved else plan_switch(cfg, setup.dims, device=device)
            self._resolve(resolve_job(cfg, switch=switch, multi_node=len(set(self.slot_nodes)) > 1))
        cfg = self.cfg
        self.group = create_placement_group(self.plan, slot_nodes=self.slot_nodes)
        self._create_trainers()
        self._create_engines()  # vLLM imports in the engine actors while the trainers load
        self._create_reward_model()
        self._create_env_workers()
        self._setup_trainers()
        self._start_engines()
        self._start_reward_model()  # after the policy's engines: on CUDA each measures the memory left at start
        specs = sync_specs(ray.get(self.trainers[0].param_specs.remote(cfg.engine.dtype)), cfg, self.switch)
        from transformers import AutoConfig

        self.sync = WeightSync(self.trainers, self.engines, specs, cfg=cfg.sync,
                               hf_config=AutoConfig.from_pretrained(self.model_path),
                               method=self.sync_method, pairs=self.pairs,
                               loopback=self.slot_nodes is None or len(set(self.slot_nodes)) == 1,
                               timeout_s=cfg.fault.sync_timeout_s)
        self.sync.open()
        self._record_job()

    def _resolve(self, resolved: ResolvedJob) -> None:
        """From here on the runtime, and every actor it starts, sees the decided config: no "auto" left."""
        self.resolved, self.cfg = resolved, resolved.config
        self.device, self.switch, self.sync_method = resolved.device, resolved.switch, resolved.sync_method

    def _init_ray(self) -> None:
        if connect_ray(self.cfg, job=self.job, namespace=self.namespace):
            self._started_ray = True

    def _ray_record(self) -> dict:
        return ray_record(self.cfg, started=self._started_ray)

    def _record_job(self) -> None:
        """job.json, once the actors are up (JobFootprint.running)."""
        self.footprint.running(self.trainers + self.engines + self._reward_model_actors() + self.env_workers,
                               self._actor_names(), started_ray=self._started_ray)

    def _actor_names(self) -> list[str]:
        return [self._trainer_name(r) for r in range(len(self.trainers))] + \
            list(self._engine_names) + \
            [self._reward_model_name() for _ in self._reward_model_actors()] + \
            [self._env_worker_name(w) for w in range(len(self.env_workers))]

    def _reward_model_actors(self) -> list:
        return [self.reward_model.actor] if self.reward_model is not None else []

    def _trainer_name(self, rank: int) -> str:
        return f"colocate-{self.job}-trainer-{rank}"

    def _engine_name(self, engine: int) -> str:
        return f"colocate-{self.job}-engine-{engine}-{self._engine_generation}"

    def _trainers_on_one_node(self) -> bool:
        return self.slot_nodes is None or len(set(self.slot_nodes)) == 1

    def _create_trainers(self) -> None:
        cfg = self.cfg
        world = self.plan.num_trainer_ranks
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        one_node = self._trainers_on_one_node()
        env_vars = {"OMP_NUM_THREADS": str(cfg.trainer.num_threads), JOB_ENV: self.job,
               **(ONE_NODE_TRAINER_ENV if one_node else {})}
        actor = ray.remote(TrainerActor)
        gpu_share = TRAINER_SHARE if self.device == "cuda" else 0.0
        self.trainers = TrainerGroup([
            actor.options(name=self._trainer_name(rank),
                          **actor_options(self.group, rank, cpu_share=TRAINER_SHARE, gpu_share=gpu_share,
                                          env=env_vars)).remote(
                rank, world, cfg.trainer, self.model_path, device=self.device, pad_id=pad,
                algo=cfg.algo, sampling=cfg.rollout, engine_lora_rank=cfg.engine.max_lora_rank,
                critic=resolved_critic(cfg.critic))
            for rank in range(world)
        ])

    def _setup_trainers(self) -> None:
        # one node: the store on loopback; several: on rank 0's node address (all interfaces, torch's doing)
        host = LOOPBACK if self._trainers_on_one_node() else None
        addr, port = ray.get(self.trainers[0].rendezvous.remote(host))
        self.trainer_info = ray.get([t.setup.remote(addr, port) for t in self.trainers])

    def _create_engines(self) -> None:
        """The engine actors, each preparing (vLLM's import) at once; _start_engines builds the engines."""
        self.engines = EngineGroup(sleeps_with=self.engines.sleeps_with)
        self._engine_generation += 1
        self._engine_names = [self._engine_name(e) for e in range(self.plan.num_engines)]
        self.engines += [self._engine_actor(e) for e in range(self.plan.num_engines)]
        self._engines_prepared = [e.prepare.remote() for e in self.engines]

    def _engine_actor(self, e: int):
        """Engine `e`'s actor, named self._engine_names[e], in its bundle of the placement group (not started)."""
        cfg = self.cfg
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(EngineActor)  # rollout.update_in_pass
        where = engine_placement(self.plan, e)
        env_vars = {**engine_env(cfg.engine, self.device, where.env), JOB_ENV: self.job}
        options = actor_options(self.group, where.bundle, cpu_share=where.cpu_share, env=env_vars,
                                gpu_share=where.driver_share if self.device == "cuda" else 0.0)
        return actor.options(name=self._engine_names[e], **options).remote(
            cfg.engine, self.model_path, device=self.device, sleep_backend=self.resolved.sleep_backend,
            eos_token_id=self.tokenizer.eos_token_id, placement_env=where.env,
            speculative=speculative_config(cfg.rollout),
            update_in_pass=cfg.algo.mode == "async" and cfg.rollout.update_in_pass != "never",
            capture_routing=cfg.algo.router_replay)

    def _create_reward_model(self) -> None:
        """rollout.rewards=model:PATH or judge:PATH: the reward model's engine actor, on the policy engines' first
        slots, preparing at once (RewardEngineActor); it serves rollout.reward_model.RewardModel."""
        specs = reward_models_in(self.cfg.rollout.rewards)
        if not specs:
            return
        cfg, spec = self.cfg, specs[0]
        path = ensure_reward_model(spec.kind, spec.path, cache_dir=cfg.model.cache_dir, seed=cfg.model.seed)
        engine_cfg = reward_engine_config(cfg.engine, cfg.reward_model)
        where = reward_model_placement(self.plan)
        env_vars = {**engine_env(engine_cfg, self.device, where.env), JOB_ENV: self.job}
        options = actor_options(self.group, where.bundle, cpu_share=where.cpu_share, env=env_vars,
                                gpu_share=where.driver_share if self.device == "cuda" else 0.0)
        actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RewardEngineActor)  # EngineActor's methods
        actor = actor.options(name=self._reward_model_name(), **options).remote(
            engine_cfg, path, kind=spec.kind, rm_cfg=cfg.reward_model, device=self.device,
            sleep_backend=self.resolved.sleep_backend, placement_env=where.env)
        self.reward_model = RewardModel(actor, kind=spec.kind)
        self.engines.sleeps_with.append(self.reward_model)  # asleep with the policy's engines, on their devices
        self.reward_model_info = {"kind": spec.kind, "path": path, "slots": self.plan.reward_model_slots()}
        self._reward_model_prepared = actor.prepare.remote()

    def _start_reward_model(self) -> None:
        if self.reward_model is not None:
            ray.get(self._reward_model_prepared)
            actor = self.reward_model.actor
            self.reward_model_info.update(ray.get(actor.start.remote()), devices=ray.get(actor.device_names.remote()))

    def _create_env_workers(self) -> None:
        """rollout.env_workers actors, outside the placement group and reserving no CPU (rollout/env_workers.py)."""
        from colocate.rollout.env_workers import EnvWorker

        r = self.cfg.rollout
        actor = ray.remote(EnvWorker)
        self.env_workers = [
            actor.options(name=self._env_worker_name(w), num_cpus=0,
                          runtime_env={"env_vars": {JOB_ENV: self.job, "TOKENIZERS_PARALLELISM": "false"}}).remote(
                r.env, length=r.task_length, model_path=self.model_path, timeout_s=r.env_timeout_s)
            for w in range(r.env_workers if r.env else 0)]

    def _reward_model_name(self) -> str:
        return f"colocate-{self.job}-reward-model"

    def _env_worker_name(self, worker: int) -> str:
        return f"colocate-{self.job}-env-worker-{worker}"

    def _start_engines(self) -> None:
        if not self.engines:
            self._create_engines()
        ray.get(self._engines_prepared)
        if self._adapter_shapes is None:  # a LoRA job's adapter, which every engine (restarted ones too) installs
            self._adapter_shapes = ray.get(self.trainers[0].adapter_shapes.remote())
        self.engine_info = ray.get([e.start.remote(self._adapter_shapes) for e in self.engines])
        self.pairs = self._pair_trainers_with_workers()

    def _pair_trainers_with_workers(self) -> list[tuple[int, int] | None]:
        """Read back every actor's device and pair each engine worker with the trainer rank beside it; a worker
        with no trainer on its device is a placement error, raised here, before the first sync."""
        trainer_devices = ray.get([t.device_name.remote() for t in self.trainers])
        worker_devices = ray.get([e.device_names.remote() for e in self.engines])
        # split: no worker has a trainer beside it; the broadcast sync needs none
        pairs = [None] * len(trainer_devices) if self.plan.split else pair_devices(trainer_devices, worker_devices)
        self.placement_report = {"trainer_devices": trainer_devices, "engine_worker_devices": worker_devices,
                                 "pairs": pairs, "slot_nodes": self.slot_nodes,
                                 "trainer_nodes": ray.get([t.node_id.remote() for t in self.trainers]),
                                 "engine_nodes": ray.get([e.node_id.remote() for e in self.engines])}
        return pairs

    def replace_engine(self, e: int, pids: list[int]) -> dict:
        """Engine `e` alone replaced by a fresh one on its slots (fault.engine_restarts, job/engine_restarts.py):
        its actor and its processes `pids` (the workers too: a stopped one follows no signal but SIGKILL, and a
        live one would hold its device) killed and awaited, then a new actor in the same bundle, started. The
        caller rejoins the sync (WeightSync.rejoin) and records the job (record_job). Returns the new engine's
        start figures. Hazard: another node's processes are not awaited (they die with their actor, Ray's fate
        sharing): on a GPU a worker still exiting there can hold memory the new engine's start measures."""
        from colocate.host.procfs import process_state

        old = self.engines[e]
        with contextlib.suppress(Exception):  # already gone
            ray.kill(old, no_restart=True)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # on a GPU the new engine measures the memory its slot has free
        while any(process_state(pid) not in (None, "Z") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._engine_generation += 1
        self._engine_names[e] = self._engine_name(e)
        self.engines[e] = self._engine_actor(e)
        ray.get(self.engines[e].prepare.remote())
        info = ray.get(self.engines[e].start.remote(self._adapter_shapes))
        self.engine_info[e] = info
        report = self.placement_report
        report["engine_worker_devices"][e] = ray.get(self.engines[e].device_names.remote())
        report["engine_nodes"][e] = ray.get(self.engines[e].node_id.remote())
        return info

    def record_job(self) -> None:
        """job.json again, after an engine was replaced (its actor's name is new). It asks every actor in its
        default concurrency group, so it waits for the passes the other engines still run: call it outside a phase
        with a deadline."""
        self._record_job()

    def restart_engines(self) -> None:
        """Replace every engine with a fresh one (after a crash, or to change engine settings) and rebuild the
        sync plan and rings from the new engines' layout."""
        for engine in self.engines:
            ray.get(engine.shutdown.remote())
            ray.kill(engine, no_restart=True)
        self.engines = EngineGroup(sleeps_with=self.engines.sleeps_with)
        self._start_engines()
        self.sync.engines = self.engines
        self.sync.pairs = self.pairs
        self.sync.open()
        self._record_job()

    def close(self, *, engine_timeout_s: float = 60) -> None:
        """Idempotent teardown; every step tolerates a half-started runtime."""
        reward_model = self._reward_model_actors()
        stop_actors(self.engines + self.trainers + reward_model + self.env_workers, engines=self.engines + reward_model,
                    engine_timeout_s=engine_timeout_s)
        self.engines, self.trainers, self.reward_model, self.env_workers = EngineGroup(), TrainerGroup(), None, []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        self.footprint.release()


def sync_specs(specs: list[TensorSpec], cfg: JobConfig, switch) -> list[TensorSpec]:
    """What each sync sends. A LoRA job's engine keeps the frozen base it loaded, so the adapter alone, unless the
    engine discards its weights while the trainer trains (sleep level 2): then the base too, every step."""
    if not cfg.trainer.lora.rank or switch.engine_sleep_level == 2:
        return specs
    return [s for s in specs if is_adapter(s.name)]
