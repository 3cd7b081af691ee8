"""Runtime: bring the co-located actors up on Ray, and take every one of them down again.

    with Runtime(cfg, setup) as rt: # Ray (local or cluster), placement group, trainers, engines, sync ring
        rt.trainers, rt.engines, rt.sync, rt.tokenizer, rt.setup.task
    # on exit (normal, exception, Ctrl-C): engines shut down (their TP worker processes exit with them),
    # actors killed, placement group removed, Ray stopped if we started it; no /dev/shm segment stays behind.

Each runtime is one job with a random token (`self.job`): its segments' names, its Ray namespace
(`colocate-<job>`) and its actors' names carry it, and <logging.output_dir>/job.json records what it started, so
`colocate clean` can remove what a SIGKILLed controller left and nothing else (colocate/host/clean.py). The Ray it
starts itself listens on loopback only; so does the trainers' TCPStore when they share one node
(docs/security.md).

Start-up order matters for memory: trainers load and shard first, engines start after (each engine measures
free memory for its KV cache at start), then the ring is opened and sealed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time

import ray

from colocate.config import JobConfig
from colocate.config.reward_model import reward_models_in
from colocate.engine.actor import EngineActor, engine_env
from colocate.engine.reward_engine import RewardEngineActor, reward_engine_config
from colocate.host.clean import JobRecord
from colocate.host.procfs import actor_processes, process_tree, processes_with_env, same_process, stop_processes
from colocate.host.rpc_dirs import remove_stale_rpc_dirs
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
from colocate.job.resolve import ResolvedJob, resolve_job
from colocate.job.setup import JobSetup, bare_setup
from colocate.models.sources import ensure_reward_model
from colocate.rollout.reward_model import RewardModel
from colocate.sync.buckets import TensorSpec
from colocate.sync.tp_layout import is_adapter
from colocate.host.shm import (
    JOB_ENV,
    mapped_by,
    new_job_token,
    remove_orphaned_entries,
    remove_stale_segments,
    shm_entries,
)
from colocate.sync.weight_sync import WeightSync
from colocate.trainer.actor import TrainerActor

log = logging.getLogger("colocate")

LOOPBACK = "127.0.0.1"
# Trainers on one node: gloo on loopback, every rank a client of the store rank 0's actor hosts on loopback
# (TrainerActor.rendezvous). GLOO_SOCKET_IFNAME: else gloo listens on the address the hostname resolves to.
ONE_NODE_TRAINER_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo"}
# The job's actors at the priority of the node's Ray daemons (whoever started them: this driver, or `ray start`),
# not 15 below it. Every Ray worker process calls nice(worker_niceness), default 15, as its core worker starts
# (Ray's src/ray/common/ray_config_def.h and the CoreWorker constructor; 2.60's _raylet.so logs "Adjusted worker
# niceness to") to keep the CPU for its daemons and the driver; a job's actors are its main work, and beside any
# busy nice-0 process they got about 4% of a core each (tests/e2e/test_multinode.py finished no step in 300 s).
# RayConfig reads RAY_worker_niceness in each worker's own environment, so the job's runtime_env sets it for
# every actor of this job and what they start (vLLM's Ray workers inherit the runtime_env; the TP workers the
# actors fork inherit their nice): Ray's own job manager does the same for its supervisor actor
# (dashboard/modules/job/job_manager.py). Per job, not per cluster: on a cluster the job joins, other jobs'
# workers keep the cluster's setting. Hazard: a Ray started with _system_config worker_niceness would override
# this (the system config is applied over the environment). See docs/cluster.md.
ACTOR_PRIORITY_ENV = {"RAY_worker_niceness": "0"}


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
        self._shm_before = shm_entries()  # what /dev/shm held before us: close() leaves those alone
        self.job = new_job_token()
        self.namespace = f"colocate-{self.job}"
        self.record = JobRecord(cfg.logging.output_dir, self.job)
        self._recorded = False
        self._job_processes: list[dict] = []  # this host's processes of the job, stopped at close if still alive
        # The driver's children from before the job (a caller's own subprocesses; under pytest, the worker's
        # multiprocessing resource tracker) are not the job's: close() must never stop them.
        self._driver_children_before = {e["pid"] for e in process_tree(os.getpid())[1:]}
        self._engines_prepared: list = []  # the engines' prepare() calls in flight
        self._adapter_shapes: dict | None = None  # a LoRA job's adapter ({} otherwise), asked of the trainers once
        self._engine_generation = 0  # actor names must be new: a killed actor's name is freed asynchronously

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
        remove_stale_segments()
        remove_stale_rpc_dirs()
        self.record.update()  # before anything that could leave something behind
        self._recorded = True
        if self.setup is None:  # decided before Ray takes its share of the memory the switch plan measures
            self.setup = bare_setup(cfg)
        setup = self.setup
        self.model_path, self.tokenizer = setup.model_path, setup.tokenizer
        if not cfg.placement.ray_address:
            assert setup.resolved is not None and setup.slots is not None, "a local job's set-up plans its slots"
            self._resolve(setup.resolved)
            self.plan = setup.slots
        self._init_ray()
        self.record.update(ray=self._ray_record())
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
        if ray.is_initialized():
            return
        verbose = self.cfg.logging.level in ("DEBUG", "INFO")
        env = {"PYTHONPATH": os.pathsep.join(_python_path()), JOB_ENV: self.job, **ACTOR_PRIORITY_ENV}
        common = dict(log_to_driver=verbose, logging_level=logging.WARNING, namespace=self.namespace,
                      runtime_env={"env_vars": env})
        with _sigterm_handler_kept():
            self._connect_ray(common)

    def _connect_ray(self, common: dict) -> None:
        if self.cfg.placement.ray_address:
            ray.init(address=self.cfg.placement.ray_address, **common)
        else:
            # address="local": a new Ray of our own, even when `ray start` left a head running on this machine
            # (plain ray.init() would join that one). A logical CPU per core at least: a slot is a scheduling
            # unit, the cores are shared by design.
            # Task events off: the GCS keeps a record of every actor call (up to 100k) for the dashboard and
            # `ray list tasks`, which a Ray of our own has no use for; the soak bench measured it as the one thing
            # growing step after step (gcs_server RSS +25% over 200 steps, +1.7% without).
            with _loopback_only():
                ray.init(address="local", num_cpus=max(os.cpu_count() or 1, self.cfg.placement.num_slots),
                         include_dashboard=False, dashboard_host=LOOPBACK, _node_ip_address=LOOPBACK,
                         _system_config={"task_events_report_interval_ms": 0,
                                         # no idle workers started ahead: every actor of ours needs a worker
                                         # of its own environment (runtime_env), which these are not
                                         "prestart_worker_first_driver": False}, **common)
            self._started_ray = True

    def _ray_record(self) -> dict:
        context = ray.get_runtime_context()
        node = getattr(ray._private.worker, "_global_node", None)  # private: the session dir has no public API
        return {"started": self._started_ray, "address": self.cfg.placement.ray_address or "local",
                "gcs_address": context.gcs_address, "namespace": context.namespace,
                "session_dir": node.get_session_dir_path() if node is not None else None}

    def _record_job(self) -> None:
        """job.json, once the actors are up: their names, the processes of the job on this host (each actor's
        tree with its vLLM workers; with a Ray of our own, every descendant of this process), and the /dev/shm
        entries that appeared since the job began and that those processes or this one map (vLLM's: their names
        say nothing of the job; an entry of another job started meanwhile is mapped by that job's processes)."""
        here = socket.gethostname()
        trees = ray.get([a.__ray_call__.remote(actor_processes) for a in self.trainers + self.engines +
                         self._reward_model_actors() + self.env_workers])
        processes = {e["pid"]: e for tree in trees if tree["host"] == here for e in tree["processes"]}
        if self._started_ray:
            processes.update({e["pid"]: e for e in process_tree(os.getpid())[1:] if self._started_for_job(e)})
        new = shm_entries() - self._shm_before
        # vLLM's engine (multiprocessing) names two semaphores (sem.mp-*) that only the engine's resource
        # tracker would unlink, and a SIGKILLed job's tracker dies with it. Their names carry no job; the engine
        # actor that created them maps them (by inode: mapped_by), which makes them this job's and no other's.
        self._job_processes = list(processes.values())
        self.record.update(state="running", actors=self._actor_names(), processes=list(processes.values()),
                           shm=sorted(mapped_by(new, pids=[os.getpid(), *processes])))

    def _started_for_job(self, entry: dict) -> bool:
        """A descendant of this driver that the job started: not one from before it, nor this process's own
        multiprocessing resource tracker (which serves the driver, and lives as long as it: stopping it at close,
        as the job's, left every semaphore it tracked for this process to nobody; a pytest worker running
        in-process runtimes warned "resource_tracker: process died unexpectedly")."""
        if entry["pid"] in self._driver_children_before:
            return False
        from multiprocessing import resource_tracker

        return entry["pid"] != getattr(resource_tracker._resource_tracker, "_pid", None)

    def _actor_names(self) -> list[str]:
        return [self._trainer_name(r) for r in range(len(self.trainers))] + \
            [self._engine_name(e) for e in range(len(self.engines))] + \
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
        env = {"OMP_NUM_THREADS": str(cfg.trainer.num_threads), JOB_ENV: self.job,
               **(ONE_NODE_TRAINER_ENV if one_node else {})}
        actor = ray.remote(TrainerActor)
        gpu_share = TRAINER_SHARE if self.device == "cuda" else 0.0
        self.trainers = TrainerGroup([
            actor.options(name=self._trainer_name(rank),
                          **actor_options(self.group, rank, cpu_share=TRAINER_SHARE, gpu_share=gpu_share,
                                          env=env)).remote(
                rank, world, cfg.trainer, self.model_path, device=self.device, pad_id=pad,
                algo=cfg.algo, sampling=cfg.rollout, engine_lora_rank=cfg.engine.max_lora_rank)
            for rank in range(world)
        ])

    def _setup_trainers(self) -> None:
        # one node: the store on loopback; several: on rank 0's node address (all interfaces, torch's doing)
        host = LOOPBACK if self._trainers_on_one_node() else None
        addr, port = ray.get(self.trainers[0].rendezvous.remote(host))
        self.trainer_info = ray.get([t.setup.remote(addr, port) for t in self.trainers])

    def _create_engines(self) -> None:
        """The engine actors, each preparing (vLLM's import) at once; _start_engines builds the engines."""
        cfg = self.cfg
        actor = ray.remote(EngineActor)
        self.engines = EngineGroup(sleeps_with=self.engines.sleeps_with)
        self._engine_generation += 1
        for e in range(self.plan.num_engines):
            where = engine_placement(self.plan, e)
            env = {**engine_env(cfg.engine, self.device, where.env), JOB_ENV: self.job}
            options = actor_options(self.group, where.bundle, cpu_share=where.cpu_share, env=env,
                                    gpu_share=where.driver_share if self.device == "cuda" else 0.0)
            self.engines.append(actor.options(name=self._engine_name(e), **options).remote(
                cfg.engine, self.model_path, device=self.device, sleep_backend=self.resolved.sleep_backend,
                eos_token_id=self.tokenizer.eos_token_id, placement_env=where.env))
        self._engines_prepared = [e.prepare.remote() for e in self.engines]

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
        env = {**engine_env(engine_cfg, self.device, where.env), JOB_ENV: self.job}
        options = actor_options(self.group, where.bundle, cpu_share=where.cpu_share, env=env,
                                gpu_share=where.driver_share if self.device == "cuda" else 0.0)
        actor = ray.remote(RewardEngineActor).options(name=self._reward_model_name(), **options).remote(
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
        for engine in self.engines + self._reward_model_actors():
            try:
                ray.get(engine.shutdown.remote(), timeout=engine_timeout_s)
            except Exception as e:  # a dead engine is what we are cleaning up after
                log.debug("engine shutdown: %s", e)
        for actor in self.engines + self.trainers + self._reward_model_actors() + self.env_workers:
            ray.kill(actor, no_restart=True)
        self.engines, self.trainers, self.reward_model, self.env_workers = EngineGroup(), TrainerGroup(), None, []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False
        # What outlived its actor: a vLLM worker stopped (SIGSTOP) or stuck in a syscall does not follow its
        # engine's death; SIGKILL reaches it anyway. Only this job's recorded processes, on this host.
        stopped, self._job_processes = self._job_processes, []
        # and every process here that carries the job's token but was not recorded (an engine restarted after the
        # record, a worker its tree did not show yet): a test file's teardown found a TP engine's vLLM segments
        # (cpushm) left mapped past the clean-up with a second file beside it
        recorded = {e["pid"] for e in stopped}
        stopped += [e for e in processes_with_env(JOB_ENV, self.job) if e["pid"] not in recorded | {os.getpid()}]
        # a resource tracker exits by itself once its process's holders are gone, having unlinked the
        # semaphores they named; on a loaded machine that can take more than a moment
        stop_processes(stopped, grace_s=2.0, tracker_grace_s=10.0)
        remove_stale_segments()
        remove_stale_rpc_dirs()
        self._remove_orphaned_segments(stopped)
        if self._recorded:  # every actor and segment of the job is gone: `colocate clean` has nothing to do
            self.record.update(state="closed", closed_at=time.time())

    def _remove_orphaned_segments(self, stopped: list[dict], timeout_s: float = 15) -> None:
        """Unlink the entries that appeared during the job and that no process maps any more. Killed workers take
        a moment to exit, and until they have their segments still look mapped: wait while a process of this job
        (one stopped, or a descendant of this driver) maps one of them. An entry that only processes outside the
        job map is another job's (a second job beside this one): nothing to wait for."""
        new = shm_entries() - self._shm_before
        deadline = time.monotonic() + timeout_s
        while new and time.monotonic() < deadline:
            new -= set(remove_orphaned_entries(new))
            ours = [e["pid"] for e in stopped + process_tree(os.getpid())[1:] + processes_with_env(JOB_ENV, self.job)
                    if same_process(e)]
            if not new or not mapped_by(new, pids=ours):
                return
            time.sleep(0.5)


def sync_specs(specs: list[TensorSpec], cfg: JobConfig, switch) -> list[TensorSpec]:
    """What each sync sends. A LoRA job's engine keeps the frozen base it loaded, so the adapter alone, unless the
    engine discards its weights while the trainer trains (sleep level 2): then the base too, every step."""
    if not cfg.trainer.lora.rank or switch.engine_sleep_level == 2:
        return specs
    return [s for s in specs if is_adapter(s.name)]


@contextlib.contextmanager
def _sigterm_handler_kept():
    """ray.init installs Ray's crash handler for SIGTERM in the driver, which logs and ends the process without
    unwinding: the caller's handler (host.signals.catch_stop_signals, which releases actors and segments) is put
    back."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    yield
    if main and callable(handler):
        signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def _loopback_only():
    """Make the Ray that ray.init starts listen on 127.0.0.1 only.

    _node_ip_address="127.0.0.1" alone does not: ray.init turns a loopback address into the node's routable one
    (ray/_private/services.py resolve_ip_for_localhost), unless ray_constants.ENABLE_RAY_CLUSTER is off, which
    Ray reads from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import. With the node address 127.0.0.1, gcs_server
    and the raylet bind their gRPC servers to 127.0.0.1 instead of 0.0.0.0, and the agents, monitor and
    workers follow (tests/e2e/test_isolation.py lists every listener). Hazard: a private constant of Ray, so
    that test guards it; the daemons inherit the variable when they start, so both are put back afterwards (a
    later runtime in this process may join a cluster)."""
    from ray._private import ray_constants

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_flag = os.environ.get(name), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[name], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved_env


def _python_path() -> list[str]:
    """Make the actors import this checkout's colocate (and the user's reward modules) like the driver does."""
    import colocate

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(colocate.__file__)))
    return [package_root, os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
