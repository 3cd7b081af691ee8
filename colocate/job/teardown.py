"""A job's footprint on this host: recorded as the runtime starts it, taken away when the job ends, whatever ends
it (its last step, an exception, Ctrl-C). The footprint is the job's actors, the processes they leave behind (a
vLLM worker stopped or stuck in a syscall does not follow its engine's death), its /dev/shm entries, and
<logging.output_dir>/job.json, which `colocate clean` (host/clean.py) reads after a SIGKILLed driver.

    footprint = JobFootprint(cfg.logging.output_dir, job)  # what this host held before the job
    footprint.begin()                          # what dead jobs left removed; job.json: the job began
    ... Ray, the actors ...
    footprint.running(actors, names, started_ray=True)     # job.json: the actors, processes and entries
    stop_actors(actors, engines=engines, engine_timeout_s=60)  # engines shut down, then every actor killed
    footprint.release()                        # what outlived its actor stopped, orphaned entries unlinked

Only the job's own: a process from before the job, another job's segment, the driver's own resource tracker
are never touched. Runtime.close (job/runtime.py) runs the last two steps, and tolerates a half-started job.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import ray

from colocate.host.clean import JobRecord
from colocate.host.procfs import actor_processes, process_tree, processes_with_env, same_process, stop_processes
from colocate.host.rpc_dirs import remove_stale_rpc_dirs
from colocate.host.shm import JOB_ENV, mapped_by, remove_orphaned_entries, remove_stale_segments, shm_entries

log = logging.getLogger("colocate")


class JobFootprint:
    def __init__(self, output_dir: str, job: str):
        """`job`: the job's token, which its segments' names and its processes' environments carry."""
        self.job = job
        self.record = JobRecord(output_dir, job)
        self._recorded = False
        self._shm_before = shm_entries()  # what /dev/shm held before us: release() leaves those alone
        self._processes: list[dict] = []  # this host's processes of the job, stopped at release if still alive
        self._shm: set[str] = set()  # the new entries the job's processes mapped when it was recorded: its own
        # The driver's children from before the job (a caller's own subprocesses; under pytest, the worker's
        # multiprocessing resource tracker) are not the job's: release() must never stop them.
        self._driver_children_before = {e["pid"] for e in process_tree(os.getpid())[1:]}

    def begin(self) -> None:
        """Before anything that could leave something behind: what dead jobs left is removed, and job.json says
        that this job began."""
        remove_stale_segments()
        remove_stale_rpc_dirs()
        self.record.update()
        self._recorded = True

    def running(self, actors: list, names: list[str], *, started_ray: bool) -> None:
        """job.json, once the actors are up: their names, the processes of the job on this host (each actor's
        tree with its vLLM workers; with a Ray of our own, every descendant of this process), and the /dev/shm
        entries that appeared since the job began and that those processes or this one map (vLLM's: their names
        say nothing of the job; an entry of another job started meanwhile is mapped by that job's processes)."""
        here = socket.gethostname()
        trees = ray.get([a.__ray_call__.remote(actor_processes) for a in actors])
        processes = {e["pid"]: e for tree in trees if tree["host"] == here for e in tree["processes"]}
        if started_ray:
            processes.update({e["pid"]: e for e in process_tree(os.getpid())[1:] if self._started_for_job(e)})
        new = shm_entries() - self._shm_before
        # vLLM's engine (multiprocessing) names two semaphores (sem.mp-*) that only the engine's resource
        # tracker would unlink, and a SIGKILLed job's tracker dies with it. Their names carry no job; the engine
        # actor that created them maps them (by inode: mapped_by), which makes them this job's and no other's.
        self._processes = list(processes.values())
        self._shm = mapped_by(new, pids=[os.getpid(), *processes])
        self.record.update(state="running", actors=names, processes=list(processes.values()), shm=sorted(self._shm))

    def _started_for_job(self, entry: dict) -> bool:
        """A descendant of this driver that the job started: not one from before it, nor this process's own
        multiprocessing resource tracker (which serves the driver, and lives as long as it: stopping it at close,
        as the job's, left every semaphore it tracked for this process to nobody; a pytest worker running
        in-process runtimes warned "resource_tracker: process died unexpectedly")."""
        if entry["pid"] in self._driver_children_before:
            return False
        from multiprocessing import resource_tracker

        return entry["pid"] != getattr(resource_tracker._resource_tracker, "_pid", None)

    def release(self) -> None:
        """Once the actors are killed and our Ray is down: what outlived its actor is stopped, and the entries the
        job made are unlinked. Idempotent."""
        # What outlived its actor: a vLLM worker stopped (SIGSTOP) or stuck in a syscall does not follow its
        # engine's death; SIGKILL reaches it anyway. Only this job's recorded processes, on this host.
        stopped, self._processes = self._processes, []
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
        job map is another job's (a second job beside this one): nothing to wait for. An entry the job's processes
        mapped when it was recorded is the job's whoever maps it now: it is waited for too (a killed TP worker
        that is still exiting may no longer be found among the job's processes, and its vLLM cpushm segments
        were left behind when the wait ended early: test_split's teardown, twice, with a second file beside it)."""
        new = shm_entries() - self._shm_before
        deadline = time.monotonic() + timeout_s
        while new and time.monotonic() < deadline:
            new -= set(remove_orphaned_entries(new))
            ours = [e["pid"] for e in stopped + process_tree(os.getpid())[1:] + processes_with_env(JOB_ENV, self.job)
                    if same_process(e)]
            if not new or not new & self._shm and not mapped_by(new, pids=ours):
                return
            time.sleep(0.5)


def stop_actors(actors: list, *, engines: list, engine_timeout_s: float) -> None:
    """Shut the `engines` (a subset of `actors`) down first, so that their TP worker processes exit with them,
    then kill every actor. After a failure an engine may be stuck behind a dead or stopped worker: the caller
    gives it less time (`engine_timeout_s`)."""
    for engine in engines:
        try:
            ray.get(engine.shutdown.remote(), timeout=engine_timeout_s)
        except Exception as e:  # a dead engine is what we are cleaning up after
            log.debug("engine shutdown: %s", e)
    for actor in actors:
        ray.kill(actor, no_restart=True)
