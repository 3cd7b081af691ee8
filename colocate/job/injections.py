"""fault.inject: SIGNAL:MEMBER:PHASE:STEP, a signal sent to one process of the job as a phase of a step begins (chaos
testing, the fault tests); the watchdog fires each once (job/faults.py)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Injection:
    """fault.inject: a signal for one member as a phase of a step begins (chaos testing, the fault tests)."""
    signal: signal.Signals
    member: str  # as Member.name: "trainer rank 1", "engine 0", "engine 0 TP worker 1"
    phase: str
    step: int
    spec: str = ""  # as given: a restart drops the injections that fired and keeps the others (job/run.py)


_PHASES = ("rollout", "score", "switch", "train", "rollout_wait", "sync", "checkpoint", "eval", "metrics")
_INJECT_FORMAT = "SIGNAL:MEMBER:PHASE:STEP, e.g. SIGKILL:engine0.worker1:rollout:2 (members: trainerR, engineE, " \
                 f"engineE.workerK; phases: {', '.join(_PHASES)})"


def parse_injections(spec: str) -> tuple[Injection, ...]:
    """fault.inject: one injection, or several separated by commas (each fires once in the job's life: a restart
    does not repeat the ones that fired, so one job can meet a fault, restart, and meet the next)."""
    return tuple(parse_injection(part.strip(), whole=spec) for part in spec.split(",") if part.strip())


def parse_injection(spec: str, *, whole: str | None = None) -> Injection:
    from colocate.errors import ConfigError

    def bad(why: str) -> ConfigError:
        return ConfigError(f"fault.inject={whole or spec!r} is invalid: {why}; expected {_INJECT_FORMAT}")

    parts = spec.split(":")
    if len(parts) != 4:
        raise bad("four fields separated by ':'")
    sig, member, phase, step = parts
    try:
        signum = signal.Signals[sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()]
    except KeyError:
        raise bad(f"unknown signal {sig!r}") from None
    match = re.fullmatch(r"trainer(\d+)|engine(\d+)(?:\.worker(\d+))?", member)
    if not match:
        raise bad(f"unknown member {member!r}")
    if phase not in _PHASES:
        raise bad(f"unknown phase {phase!r}")
    if not step.isdigit():
        raise bad(f"step {step!r} is not a step number")
    trainer, engine, worker = match.groups()
    name = f"trainer rank {trainer}" if trainer is not None else \
        f"engine {engine}" + (f" TP worker {worker}" if worker is not None else "")
    return Injection(signum, name, phase, int(step), spec)
