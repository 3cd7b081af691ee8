"""Faults: a dead or stuck actor found within a bounded time and named (which actor, its slots and node, the
phase, the cause), instead of Ray's "RuntimeError: cancelled" minutes later or a hang forever.

    with Watchdog(cfg.fault, runtime) as watchdog:      # a thread beside the controller's step loop
        with watchdog.phase("rollout", step):           # deadline fault.rollout_timeout_s (0: none)
            ...                                         # ray.get of the phase's calls
    # raises JobFault: "engine 0 TP worker 1 (slot 1, node 3f2a9c01, pid 4242) died during rollout of step 3:
    # killed by SIGKILL"

Two ways a fault shows:
- An error out of a `ray.get` (Ray's ActorDiedError, or an engine's own error once vLLM noticed its worker gone):
  `explain` maps it to the member by the failing process's pid and names it.
- Nothing returns: every `fault.heartbeat_s` the watchdog thread checks each member process on this host (dead,
  zombie, stopped) and the phase's deadline; on a finding it interrupts the main thread (`_thread.interrupt_main`,
  which Ray's blocking `get` honours like Ctrl-C) and the controller raises the stored `JobFault` instead.
Members on other nodes are watched by Ray itself: a lost node's actors fail their calls (after Ray's own health
check), and `explain` names them by actor id.

The first error out of a `ray.get` is often not the cause but its echo: when a node is lost, a surviving trainer's
collective fails at once ("gloo ... Connection reset by peer"), seconds before Ray's health check declares the
node dead. So before it reports a Ray error, `explain` looks for a root cause: a member on this node that is gone
or stopped, then a member that does not answer a probe, for which it waits (at most `LOSS_WAIT_S`) until Ray
says whether its node or its actor died. A member that answers, or a lost one nobody confirms, leaves the
original error as it was.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import re
import signal
import threading
import time

import ray

from colocate.errors import JobFault
from colocate.host.procfs import process_state
from colocate.job.injections import Injection, parse_injections
from colocate.job.members import Member, job_members, member_fault

# The watchdog's interrupt: `_thread.interrupt_main(signum)` runs signum's Python handler in the main thread (the OS
# never sends it). Not SIGINT: interrupt_main does nothing for a signal Python does not handle, and a job started
# in the background by a non-interactive shell inherits SIGINT ignored, which Python keeps (seen: a stopped worker
# found, never reported, the job hung).
INTERRUPT_SIGNAL = signal.SIGUSR2
PROBE_TIMEOUT_S = 5.0  # a member's pid() that does not return within this is silent: busy, or lost
LOSS_WAIT_S = 60.0  # how long a silent member's fate is awaited (Ray's health check takes ~15-30 s by default)
# How long a dead TP worker's engine actor is awaited for the exit it recorded. Its worker_deaths() answers at once
# (a concurrency group of its own, engine/actor.py PROBE) and is asked again until the record holds a death: the
# record follows the death by milliseconds, once the actor's watcher reads the exit status; the bound is for a
# loaded machine.
DEATH_RECORD_WAIT_S = 60.0


class WatchdogInterrupt(KeyboardInterrupt):
    """The watchdog interrupting the main thread: a KeyboardInterrupt, the one exception Ray's blocking get lets
    through its signal check; phase() replaces it with the stored JobFault."""


def _raise_watchdog_interrupt(signum, frame):
    raise WatchdogInterrupt()


def signal_name(exit_code: int | None) -> str:
    """multiprocessing's exit code as a cause: -9 -> "killed by SIGKILL", 3 -> "exited with code 3"."""
    if exit_code is None:
        return "gone (exit status unknown)"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


class Watchdog:
    """Watches the job's members while the controller runs its phases (see the module docstring)."""

    def __init__(self, cfg, runtime):
        self.cfg, self.runtime = cfg, runtime
        self.local_node = ray.get_runtime_context().get_node_id()
        self.members = job_members(runtime)
        self.fault: JobFault | None = None
        self.injections = parse_injections(cfg.inject)
        self.fired: list[Injection] = []  # in the order they fired
        self._phase: tuple[str, int | None, float | None] | None = None  # (name, step, deadline)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread interrupts only while the main thread is inside a phase
        self._thread: threading.Thread | None = None
        self._signum = signal.SIGINT  # __enter__ installs INTERRUPT_SIGNAL's handler when it can (main thread)
        self._previous_handler = None
        self._deferring = False  # fault.engine_restarts: interrupt only inside a wait on the engines (deferring)
        self._waiting = False  # ... which is now

    # ------------------------------------------------------------------------------------------- life

    def __enter__(self) -> Watchdog:
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, _raise_watchdog_interrupt)
            self._signum = INTERRUPT_SIGNAL
        self._thread = threading.Thread(target=self._watch, name="colocate-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._signum == INTERRUPT_SIGNAL:
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler)
            self._signum = signal.SIGINT

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None):
        timeout = self.timeout_s(name)
        self._phase = (name, step, time.monotonic() + timeout if timeout else None)
        self._inject(name, step)
        try:
            yield
        except BaseException as e:
            with self._lock:  # from here the thread interrupts no more: this error is being explained
                self._phase = None
            if self.fault is not None:  # the thread's finding, delivered as an interrupt
                raise self.fault from None
            if isinstance(e, Exception) and not isinstance(e, JobFault):
                raise self.explain(e, name, step) from e
            raise
        finally:
            with self._lock:
                self._phase = None

    def _inject(self, phase: str, step: int | None) -> None:
        for i in self.injections:
            if (i.phase, i.step) != (phase, step) or i in self.fired:  # a phase run again (an engine restarted)
                continue
            member = next((m for m in self.members if m.name == i.member), None)
            if member is None:
                raise JobFault(f"fault.inject names {i.member}, which this job does not have; it has "
                               f"{', '.join(m.name for m in self.members)}")
            assert member.node == self.local_node, "fault.inject reaches processes on the controller's node only"
            self.fired.append(i)
            os.kill(member.pid, i.signal)

    # ------------------------------------------------------------- fault.engine_restarts (job/engine_restarts.py)

    def forget_engine(self, engine: int) -> list[Member]:
        """Stop watching engine `engine`'s processes (it is being replaced) and drop the fault found in it, so the
        job can go on; returns its members, whose processes the runtime kills. Called between phases: the
        thread interrupts only inside one."""
        with self._lock:
            gone = [m for m in self.members if m.engine == engine]
            self.members = [m for m in self.members if m.engine != engine]
            self.fault = None
        return gone

    @contextlib.contextmanager
    def deferring(self):
        """Inside, a finding is kept (`fault`) and interrupts the main thread only inside `waiting()`: a phase that
        fault.engine_restarts runs again must not be cut where it changes its state (the rollout pool applies a
        pass's answers and hands groups over between the engines' answers; an interrupt there would leave it half
        done). The caller raises a fault kept past the block's end (job/engine_restarts.py)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    @contextlib.contextmanager
    def waiting(self):
        """A wait on the engines inside `deferring()`, where the interrupt may land; a fault kept before it is
        raised at once. Hazard: the thread interrupts under the lock, so an interrupt sent just before the wait
        ended is pending before this block's exit takes the lock, and lands at the exit's first signal check,
        before the caller's next statement: never inside the state change that follows."""
        if not self._deferring or threading.current_thread() is not threading.main_thread():
            yield
            return
        with self._lock:
            if self.fault is not None:
                raise self.fault
            self._waiting = True
        try:
            yield
        finally:
            with self._lock:
                self._waiting = False

    def watch_again(self) -> None:
        """Every member read afresh (a replaced engine's new actor and workers among them)."""
        members = job_members(self.runtime)
        with self._lock:
            self.members = members

    def timeout_s(self, phase: str) -> float:
        bounded = self.cfg.sync_timeout_s  # sync, switch, metrics: work of a known size, on the node's own memory
        # a save's time is the storage's (a network file system can take many minutes for a 7B model's 91 GB)
        return {"rollout": self.cfg.rollout_timeout_s, "rollout_wait": self.cfg.rollout_timeout_s,
                "train": self.cfg.train_timeout_s, "sync": bounded,
                "switch": bounded, "metrics": bounded, "engine_restart": bounded,
                "checkpoint": self.cfg.checkpoint_timeout_s}.get(phase, 0.0)

    # ------------------------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            current = self._phase
            if current is None or self.fault is not None:
                continue
            name, step, deadline = current
            finding = self._dead_member(name, step)
            if finding is None and name == "rollout" and self.cfg.engine_timeout_s:
                finding = self._hung_engine(name, step)
            if finding is None and deadline is not None and time.monotonic() > deadline:
                finding = self._overdue(name, step)
            with self._lock:
                if finding is not None and self._phase is current:
                    self.fault = finding
                    if not self._deferring or self._waiting:
                        _thread.interrupt_main(self._signum)  # Ray's get returns at its next signal check

    def _dead_member(self, phase: str, step: int | None) -> JobFault | None:
        for m in self.members:
            if m.node != self.local_node:
                continue  # another node's processes: Ray reports their deaths
            state = process_state(m.pid)
            if state in (None, "Z"):
                first = None
                if m.engine is not None and m.actor_id is None:  # a vLLM worker: its engine recorded how
                    first = self._first_death(m.engine, seen_dead=True)
                m, cause = first or (m, self._cause(m))
                return member_fault(m, f"{m.describe(self.local_node)} died during {_where(phase, step)}: {cause}")
            if state in ("T", "t"):
                return member_fault(m, f"{m.describe(self.local_node)} is stopped (SIGSTOP or a debugger) during "
                                    f"{_where(phase, step)}: the job cannot go on without it")
        return None

    def _hung_engine(self, phase: str, step: int | None) -> JobFault | None:
        """The engines' heartbeat (fault.engine_timeout_s): each engine says, from its probe thread, how long its
        pass has gone without an engine step; one past the bound hangs with every process alive. An engine whose
        probe does not answer within PROBE_TIMEOUT_S is left to the next look (a dead one is the state check's)."""
        engines = list(self.runtime.engines)
        refs = [engine.stalled_s.remote() for engine in engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        for e, ref in enumerate(refs):
            if ref not in ready:
                continue
            try:
                stalled = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            member = next((m for m in self.members if m.name == f"engine {e}"), None)
            if stalled is not None and stalled > self.cfg.engine_timeout_s and member is not None:
                return member_fault(member, f"{member.describe(self.local_node)} made no engine step for "
                                    f"{stalled:.1f} s during {_where(phase, step)} (fault.engine_timeout_s="
                                    f"{self.cfg.engine_timeout_s:g}): a worker or a device call hangs with every "
                                    "process alive")
        return None

    def _overdue(self, phase: str, step: int | None) -> JobFault:
        timeout = self.timeout_s(phase)
        key = {"switch": "sync", "metrics": "sync", "engine_restart": "sync",
               "rollout_wait": "rollout"}.get(phase, phase)
        return JobFault(f"{_where(phase, step)} did not finish within {timeout:g} s (fault.{key}_timeout_s): every "
                        f"process of the job is alive, so one of them hangs (a deadlock, a stuck device or "
                        f"network); members: {', '.join(m.describe(self.local_node) for m in self.members)}")

    def _cause(self, member: Member) -> str:
        """A Ray actor's process is the raylet's child: Ray keeps its exit status to itself."""
        return "its process is gone (killed, crashed, or out of memory)"

    def _first_death(self, engine: int, *, seen_dead: bool) -> tuple[Member, str] | None:
        """The engine's worker that died first, and how (its engine actor, their parent, recorded the exits in
        order: after the first, vLLM terminates the others, so whichever the watchdog saw gone is no cause).
        `seen_dead`: a worker of it is gone, so a record will come: awaited (DEATH_RECORD_WAIT_S); else one
        answer, which may hold none (an engine's error of another kind)."""
        handle = self.runtime.engines[engine]
        deaths = recorded_deaths(lambda: handle.worker_deaths.remote(), ray.get,
                                 wait_s=DEATH_RECORD_WAIT_S if seen_dead else 10.0, until_one=seen_dead)
        for _, pid, code in deaths:
            member = next((m for m in self.members if m.pid == pid and m.engine == engine), None)
            if member is not None:
                return member, signal_name(code)
        return None

    # ---------------------------------------------------------------------- errors out of ray.get

    def explain(self, error: Exception, phase: str, step: int | None) -> JobFault | Exception:
        """A JobFault naming the member behind a Ray error; other errors (a reward's, a config's) unchanged."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

        if not isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError, RayTaskError)):
            return error
        root = self._dead_member(phase, step) or self._lost_member(phase, step)
        if root is not None:
            return root
        member = self._member_of(error)
        if isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError)) and member is not None:
            cause = "its node was lost" if "node" in str(error).lower() and "died" in str(error).lower() \
                and member.node != self.local_node else self._cause(member)
            return member_fault(member, f"{member.describe(self.local_node)} died during {_where(phase, step)}: "
                                f"{cause}")
        if isinstance(error, RayTaskError) and member is not None and member.engine is not None:
            first = self._first_death(member.engine, seen_dead=False)  # an engine's error: did a worker die?
            if first is not None:
                m, cause = first
                return member_fault(m, f"{m.describe(self.local_node)} died during {_where(phase, step)}: {cause}")
        return error

    def _lost_member(self, phase: str, step: int | None) -> JobFault | None:
        """The member whose loss a Ray error echoes. Every actor member is asked its pid: one whose answer is an
        actor error died; one that does not answer is busy or lost, and is awaited (at most LOSS_WAIT_S) until
        it answers (busy: no cause), its answer fails, or Ray declares its node dead."""
        served = [self.runtime.reward_model.actor] if self.runtime.reward_model is not None else []
        handles = {h._actor_id.hex(): h for h in [*self.runtime.trainers, *self.runtime.engines, *served]}
        pending = {handles[m.actor_id].pid.remote(): m for m in self.members if m.actor_id in handles}
        deadline, timeout = time.monotonic() + LOSS_WAIT_S, PROBE_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
            dead_nodes = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
            for ref in ready:
                member = pending.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:
                    cause = "its node was lost" if member.node in dead_nodes else self._cause(member)
                    return member_fault(member, f"{member.describe(self.local_node)} died during "
                                        f"{_where(phase, step)}: {cause}")
            lost = [m for m in pending.values() if m.node in dead_nodes]
            if lost:
                return member_fault(lost[0], f"{lost[0].describe(self.local_node)} died during "
                                    f"{_where(phase, step)}: its node was lost")
            timeout = 1.0
        return None

    def _member_of(self, error: Exception) -> Member | None:
        # The RayTaskError that ray.get raises (`as_instanceof_cause`) keeps pid and actor id in its text only:
        # "ray::EngineActor.run_pass() (pid=26213, ip=..., actor_id=2fb5...)"; ActorDiedError has `actor_id`.
        text = str(error)
        actor_id = getattr(error, "actor_id", None) or _field(r"actor_id=([0-9a-f]+)", text)
        pid = getattr(error, "pid", None) or _field(r"pid=(\d+)", text)
        pid = int(pid) if pid else None
        for m in self.members:
            if (actor_id and m.actor_id == actor_id) or (pid and m.pid == pid and m.actor_id):
                return m
        return None


def recorded_deaths(call, get, *, wait_s: float, until_one: bool, poll_s: float = 0.2) -> list:
    """An engine actor's record of its workers' exits: its first answer, or with `until_one` the first answer that
    holds an exit; [] when the actor is gone or has not answered within `wait_s`. `call()` asks the actor
    (worker_deaths.remote()); `get(ref, timeout=...)` waits for the answer (ray.get). A call is asked again only
    after its answer: one in the actor's queue at a time."""
    deadline = time.monotonic() + wait_s
    ref = call()
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            deaths = get(ref, timeout=remaining)
        except Exception:  # the actor is gone, or never answered (Ray's GetTimeoutError)
            return []
        if deaths or not until_one:
            return deaths
        time.sleep(min(poll_s, max(remaining, 0.0)))  # answered before its recorder thread saw the exit
        ref = call()
    return []


def _field(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text)
    return match.group(1) if match else None


def _where(phase: str, step: int | None) -> str:
    return phase if step is None else f"{phase} of step {step}"
