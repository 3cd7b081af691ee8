"""Every error colocate reports as one line, with the exit code it ends a command with. Nothing here imports
the rest of colocate: every layer may raise these.

    UserError (exit 2)       a mistake in what the user gave, found before any work was lost
      ConfigError              a key of the job's configuration (`key=value is invalid: ...`)
      ExportError, CleanError  `colocate export` / `colocate clean` given something they must not touch
    ColocateError (exit 1)   the job or a command failed while it ran
      JobFault                 a member of the job died or stopped answering (the watchdog names it)
        DeviceMemoryShortfall    too little free device memory to map paused state back
      JobServerError, EngineStartError, PlacementError, SyncVerificationError, RewardError, NonFiniteError,
      MemorySaverError

`cli.main` and `run_job` print `colocate: error: <the error>` and return its `exit_code`: a new error needs no
new handler.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class ColocateError(Exception):
    """Something colocate reports in one line (its message) and ends the command with `exit_code`."""

    exit_code = EXIT_FAILED


class UserError(ColocateError):
    """A mistake in what the user gave; reported before any actor starts or any work is lost."""

    exit_code = EXIT_USAGE


class ConfigError(UserError, ValueError):
    """A user mistake in the job configuration; the CLI prints it as one line and exits with code 2.

    `fix`: the `key=value` overrides its hint suggests, as values of the keys' types (empty when it names no
    single value). The checks accept them, or refuse another key next (tests/unit/test_hints.py applies each)."""

    def __init__(self, message: str, *, fix: dict[str, object] | None = None):
        super().__init__(message)
        self.fix = dict(fix or {})

    def __reduce__(self):  # pickled across Ray with its fix (BaseException's own would drop the keyword)
        return type(self), self.args, {"fix": self.fix}


class ExportError(UserError, ValueError):
    """A user mistake (not a checkpoint, a bad dtype); printed as one line."""


class CleanError(UserError):
    """A run `clean` must not or cannot touch; one line for the user (exit 2)."""


class JobFault(ColocateError, RuntimeError):
    """A member of the job died or stopped answering. One line: who, where, in which phase, why."""


class EngineFault(JobFault):
    """A JobFault of one rollout engine's process (its actor or a TP worker): fault.engine_restarts can replace that
    engine alone (job/engine_restarts.py) while the job goes on."""

    def __init__(self, message: str, *, engine: int, member: str = ""):
        super().__init__(message)
        self.engine, self.member = engine, member

    def __reduce__(self):  # keyword arguments: pickled (across Ray, a process pool) as they were given
        return _engine_fault, (str(self), self.engine, self.member)


def _engine_fault(message: str, engine: int, member: str) -> EngineFault:
    return EngineFault(message, engine=engine, member=member)


class DeviceMemoryShortfall(JobFault):
    """The device has too little free memory to map the paused state back (another process holds it)."""


class JobServerError(ColocateError):
    """The job server failed while a command ran (not a user mistake): the CLI prints one line and exits 1."""


class EngineStartError(ColocateError, RuntimeError):
    """The engine did not come up (bad model, too little memory for the KV cache, ...)."""


class PlacementError(ColocateError, RuntimeError):
    """The actors did not land as the job needs (a trainer rank and the engine worker it feeds on different
    devices); raised before the first sync, as one line."""


class SyncVerificationError(ColocateError, RuntimeError):
    """An engine worker found the synced weights not where, or not what, the trainers wrote."""


class RewardError(ColocateError, RuntimeError):
    """The reward function raised on a (prompt, response), or returned something that is not a finite number."""


class EnvError(ColocateError, RuntimeError):
    """A multi-turn environment (rollout.env) raised, hung or returned the wrong type; names the sample and turn."""


class NonFiniteError(ColocateError, RuntimeError):
    """A gradient or weight of the trainer holds NaN or Inf."""


class MemorySaverError(ColocateError, RuntimeError):
    """A pause or resume torch_memory_saver would answer with `exit(1)`: refused with the owner and the tag."""
