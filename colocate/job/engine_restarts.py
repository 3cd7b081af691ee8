"""fault.engine_restarts: a rollout engine that dies or stops is replaced alone, and the job goes on.

    restarts = EngineRestarts(cfg, runtime, trace, metrics=metrics, in_flight=passes.regenerated)
    groups, stats = restarts.run("rollout", step, lambda: rollout.take(step))  # a watched phase, run again once
                                                                              # a failed engine is replaced
    events = restarts.take_events()                                           # the step's record names them

How an engine comes back (`EngineRestarts.recover`):
1. The watchdog names the engine's process that died or stopped (job/faults.py `EngineFault`: a TP worker or
   the engine actor, found by its state every fault.heartbeat_s or by the error out of the pass) and stops
   watching that engine's processes.
2. The runtime kills its actor and every process of it (a stopped worker follows no signal but SIGKILL; a live
   one would keep its device) and starts a new actor in the same bundle of the placement group, so on the same
   slots (`Runtime.replace_engine`).
3. The sync reopens its broadcast groups for every engine under a new key (the old ones hold the dead process)
   and sends the trainers' weight stores whole, which the new engine loads (`WeightSync.rejoin`): the version the
   other engines hold, read from the stores sync.delta keeps beside the trainers, with no gather of the FSDP2
   shards. The others receive it into their own stores, so the next sync is a delta for every engine.
4. The new engine is compared in full with the trainers' weights (`WeightSync.verify_full`): in algo.mode=sync,
   during a rollout or an evaluation, the trainers hold exactly the version the engines were synced to.
5. The watchdog watches the new processes and the phase runs again. A pass's results reach the rollout pool
   only once every engine of the pass answered (rollout/passes.py), so the failed pass changed nothing there:
   its requests are generated again with the same seeds, no group is lost or taken twice, and every token keeps
   the version of the weights that sampled it. The other engines' answers of that pass are kept: applied when
   the rollout runs again (Passes._apply_cut_short).

Why only there. A fault in the sync (a member lost mid-broadcast) leaves the stores of the feeders and the
engines at different versions, slice by slice; one in training, or with algo.mode=one_step_off or async, meets
engines that generate while the trainers train and sync. Those faults end the job, or fault.max_restarts restarts
it whole, as before (docs/faults.md says what a wider recovery would need). Co-located, an engine's devices are
the trainers' between phases and no store holds its weights (sync.delta runs on the split placement only).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

from colocate.config import JobConfig
from colocate.config.fields import bad
from colocate.errors import EngineFault, JobFault
from colocate.job.faults import WatchdogInterrupt

RECOVERED_PHASES = ("rollout", "eval")  # where the engines work, and the trainers hold the engines' version


def check_engine_restarts(cfg: JobConfig) -> None:
    """fault.engine_restarts where an engine can come back (the module's why); one line naming what cannot.
    `cfg`: with placement.engine_slots decided (job/split.py)."""
    from colocate.sync.delta_channel import uses_delta

    n = cfg.fault.engine_restarts
    if not n:
        return
    key, off = "fault.engine_restarts", {"fault.engine_restarts": 0}
    if not cfg.placement.split:
        raise bad(key, n, "replaces an engine on slots of its own, but co-located (placement.engine_slots=0) an "
                  "engine's devices are the trainers' between phases and no weight store keeps its weights; valid: "
                  "placement.engine_slots > 0, or fault.engine_restarts=0 with fault.max_restarts (the whole job "
                  "restarts)", fix=off)
    if cfg.algo.mode != "sync":
        raise bad(key, n, f"needs algo.mode=sync: with algo.mode={cfg.algo.mode} the engines generate while the "
                  "trainers train and sync, where a replaced engine's reload would meet the step's own sync (not "
                  "built: docs/faults.md); valid: algo.mode=sync, or fault.engine_restarts=0", fix=off)
    if cfg.sync.carrier != "group":
        raise bad(key, n, f"a replaced engine joins the broadcast's process groups, and sync.carrier="
                  f"{cfg.sync.carrier} has none (a reload through the files is not built); valid: sync.carrier="
                  "group, or fault.engine_restarts=0", fix=off)
    if not uses_delta(cfg.sync.delta, method="broadcast", adapter_only=bool(cfg.trainer.lora.rank)):
        why = "sync.delta=false" if cfg.sync.delta == "false" else \
            f"a LoRA job (trainer.lora.rank={cfg.trainer.lora.rank}) syncs its adapters alone"
        raise bad(key, n, f"a replaced engine loads the weights from the stores sync.delta keeps beside the "
                  f"trainers, which this job does not keep ({why}); valid: sync.delta=auto or true on a full "
                  "fine-tune, or fault.engine_restarts=0", fix=off)


class EngineRestarts:
    """fault.engine_restarts for one controller: the phases it runs, the budget, the events (the module's steps)."""

    def __init__(self, cfg: JobConfig, runtime, trace, *, metrics=None,
                 in_flight: Callable[[int], int] = lambda engine: 0):
        """`in_flight(engine)`: the answers a rollout run again after `engine` was replaced generates again
        (Passes.regenerated)."""
        self.cfg, self.rt, self.trace, self.metrics, self.in_flight = cfg, runtime, trace, metrics, in_flight
        self.left = cfg.fault.engine_restarts
        self.events: list[dict] = []  # since the last take_events

    def run(self, name: str, step: int, work: Callable, *, timed: bool = True):
        """`work()` as the watched phase `name` of `step`; an engine's fault in it, with restarts left, replaces
        that engine and runs `work()` again. In a rollout the fault may cut the phase short only while it waits on
        the engines (Watchdog.deferring, Passes.engine_wait): one found while the rollout pool takes a pass's
        answers or hands groups over is kept until then, and found after the phase's work ended, it replaces the
        engine without running the work again. Any other fault, and one past the bound, is raised as it was."""
        watchdog = self.trace.watchdog
        while True:
            started, finished, result = time.perf_counter(), False, None
            try:
                with self.trace.phase(name, step, timed=timed), self._deferring(name):
                    result = work()
                fault, finished = watchdog.fault if watchdog is not None else None, True
            except WatchdogInterrupt:  # the watchdog's interrupt, landed as its phase raised (not a Ctrl-C)
                fault = watchdog.fault if watchdog is not None else None
                if fault is None:
                    raise
            except EngineFault as raised:
                fault = raised
            if fault is None:
                return result
            self._check(fault, name)
            self.recover(fault, name, step, time.perf_counter() - started, again=not finished)
            if finished:
                return result

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def engine_wait(self):
        """Passes.engine_wait: where a rollout may be cut short by a fault (Watchdog.waiting)."""
        watchdog = self.trace.watchdog
        return watchdog.waiting() if watchdog is not None else contextlib.nullcontext()

    def _deferring(self, phase: str):
        """The rollout's faults kept outside its waits on the engines, when restarts are asked for: a job that asks
        none is interrupted wherever a fault is found, as always."""
        watchdog = self.trace.watchdog
        if phase != "rollout" or not self.cfg.fault.engine_restarts or watchdog is None:
            return contextlib.nullcontext()
        return watchdog.deferring()

    def _check(self, fault: JobFault, phase: str) -> None:
        """Raise `fault` unless this recovers it: an engine's, in a phase where the engines work, restarts left."""
        if not isinstance(fault, EngineFault) or phase not in RECOVERED_PHASES or self.trace.watchdog is None:
            raise fault
        if not self.left:
            if self.cfg.fault.engine_restarts:
                raise JobFault(f"{fault} (fault.engine_restarts={self.cfg.fault.engine_restarts} spent)") from None
            raise fault

    def recover(self, fault: EngineFault, phase: str, step: int, found_after_s: float = 0.0, *,
                again: bool = True) -> dict:
        """Replace the engine `fault` names, reload it from the weight stores, verify it in full (the module's
        steps); returns the event, also written to the metrics and printed. `found_after_s`: how long the phase
        ran before the fault was found (for a fault injected as the phase began, the time to find it); `again`:
        the phase runs again (else its work had ended: nothing is generated again). Raises a
        JobFault naming the first failure when the engine cannot come back (its slot out of memory, a trainer
        gone): the job ends."""
        started = time.perf_counter()
        _take_late_interrupt()
        e, watchdog = fault.engine, self.trace.watchdog
        regenerated = self.in_flight(e) if phase == "rollout" and again else 0
        gone = watchdog.forget_engine(e)
        try:
            with self.trace.phase("engine_restart", step):
                # this node's processes: another node's die with their actor (Ray's fate sharing of owned actors)
                info = self.rt.replace_engine(e, [m.pid for m in gone if m.node == watchdog.local_node])
                restarted = time.perf_counter()
                reload = self.rt.sync.rejoin([e])
                reloaded = time.perf_counter()
                mismatched = self.rt.sync.verify_full(self.cfg.engine.dtype, engines=[e])
                verified = time.perf_counter()
        except JobFault:
            raise
        except Exception as error:  # the new engine's start, or the reload: one line, the job ends
            first = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise JobFault(f"{fault}; engine {e} could not be replaced: {first}") from None
        if mismatched:
            raise JobFault(f"{fault}; engine {e} was replaced, but {len(mismatched)} of its tensors differ from the "
                           f"trainers' after the reload from the weight store, e.g. {mismatched[0]}")
        watchdog.watch_again()
        self.rt.record_job()  # the new actor's name, for `colocate clean` (after the phase: it waits on the engines)
        self.left -= 1
        event = {"event": "engine_restart", "step": step, "phase": phase, "engine": e, "member": fault.member,
                 "cause": str(fault), "found_after_s": found_after_s, "start_s": info["start_s"],
                 "restart_s": restarted - started,
                 "reload_s": reload["reload_s"], "reload_bytes": reload["reload_bytes"],
                 "store_version": reload["store_version"], "verify_s": verified - reloaded, "verified": "full",
                 "answers_regenerated": regenerated, "recovery_s": time.perf_counter() - started,
                 "restarts_left": self.left}
        print(f"colocate: {fault}\ncolocate: engine {e} replaced on its slots and reloaded from the weight store "
              f"(version {reload['store_version']}) in {event['recovery_s']:.1f} s, verified in full; "
              f"{f'the {phase} goes on' if again else 'the step goes on'} ({self.left} engine restart(s) left)",
              file=sys.stderr, flush=True)
        if self.metrics:
            self.metrics.write(event)
        self.events.append(event)
        return event


def _take_late_interrupt() -> None:
    """The watchdog's interrupt is delivered at the main thread's next bytecode, which can come just after its phase
    raised the fault: it lands here, not inside the recovery."""
    try:
        time.sleep(0.05)
    except WatchdogInterrupt:
        pass
