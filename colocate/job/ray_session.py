"""The Ray a job runs on: one of its own, listening on loopback only (no placement.ray_address), or a cluster's,
which it joins. Either way every actor of the job gets the job's token, this checkout on its import path and the
priority of the node's Ray daemons (its runtime_env).

    started = connect_ray(cfg, job=token, namespace=f"colocate-{token}")  # True: ours, shut down at close
    ray_record(cfg, started=started)  # job.json's "ray": where it is, its GCS, namespace and session directory

Runtime.start calls these (job/runtime.py); `colocate clean` reads the record (host/clean.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import ray

from colocate.config import JobConfig
from colocate.host.shm import JOB_ENV

LOOPBACK = "127.0.0.1"
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


def connect_ray(cfg: JobConfig, *, job: str, namespace: str) -> bool:
    """Ray for the job `job` (its token), unless this process has one already (a test's, a benchmark's).
    Returns whether it started a Ray of its own, which the job then shuts down at its end."""
    if ray.is_initialized():
        return False
    verbose = cfg.logging.level in ("DEBUG", "INFO")
    env = {"PYTHONPATH": os.pathsep.join(_python_path()), JOB_ENV: job, **ACTOR_PRIORITY_ENV}
    common = dict(log_to_driver=verbose, logging_level=logging.WARNING, namespace=namespace,
                  runtime_env={"env_vars": env})
    with _sigterm_handler_kept():
        if cfg.placement.ray_address:
            ray.init(address=cfg.placement.ray_address, **common)
            return False
        # address="local": a new Ray of our own, even when `ray start` left a head running on this machine
        # (plain ray.init() would join that one). A logical CPU per core at least: a slot is a scheduling
        # unit, the cores are shared by design.
        # Task events off: the GCS keeps a record of every actor call (up to 100k) for the dashboard and
        # `ray list tasks`, which a Ray of our own has no use for; the soak bench measured it as the one thing
        # growing step after step (gcs_server RSS +25% over 200 steps, +1.7% without).
        with _loopback_only():
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cfg.placement.num_slots),
                     include_dashboard=False, dashboard_host=LOOPBACK, _node_ip_address=LOOPBACK,
                     _system_config={"task_events_report_interval_ms": 0,
                                     # no idle workers started ahead: every actor of ours needs a worker
                                     # of its own environment (runtime_env), which these are not
                                     "prestart_worker_first_driver": False}, **common)
        return True


def ray_record(cfg: JobConfig, *, started: bool) -> dict:
    """The Ray this process is connected to, as job.json records it."""
    context = ray.get_runtime_context()
    node = getattr(ray._private.worker, "_global_node", None)  # private: the session dir has no public API
    return {"started": started, "address": cfg.placement.ray_address or "local",
            "gcs_address": context.gcs_address, "namespace": context.namespace,
            "session_dir": node.get_session_dir_path() if node is not None else None}


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
