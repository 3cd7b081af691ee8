"""What colocate's processes do with the signals that stop them: SIGINT is Ctrl-C (KeyboardInterrupt) and SIGTERM
unwinds like it (`Terminated`), whatever disposition the process inherited, so that every actor and shared segment
is released before it exits.

    restore = catch_stop_signals()   # run_job: SIGTERM -> Terminated, SIGINT -> KeyboardInterrupt
    take_ctrl_c()                    # the CLI's other commands (`colocate logs --follow`): SIGINT -> KeyboardInterrupt

Hazard: a process started in the background by a non-interactive shell (`make test &`, many CI runners and
wrappers) inherits SIGINT *ignored*, and one started under a Ray daemon inherits it *blocked*; Python keeps
both, installs no KeyboardInterrupt handler, and `_thread.interrupt_main()` does nothing then. Seen: a job that
ran all its steps through a Ctrl-C, and `colocate logs --follow` that never returned from one.
"""

from __future__ import annotations

import signal
import threading

from colocate.errors import EXIT_INTERRUPTED, EXIT_TERMINATED


def take_ctrl_c() -> set:
    """SIGINT raises KeyboardInterrupt in the main thread from now on (ignored or blocked before); returns the
    signal mask it had, for a restore."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        return set()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


class Terminated(BaseException):
    """SIGTERM (`colocate stop`, `ray job stop`, a scheduler's preemption): unwinds like Ctrl-C, so the runtime
    releases every actor and shared segment before the process exits."""


# The stop signals received since catch_stop_signals, whatever became of their exceptions: one raised while C
# code ran can come back wrapped (CPython's "SystemError: ... returned a result with an exception set"), and a
# library may wrap that again (Ray's errors keep theirs in `.cause`); the job still reports a stop, not an error.
_received: list[BaseException] = []


def _raise_terminated(signum, frame):
    _received.append(Terminated())
    raise _received[-1]


def _raise_interrupt(signum, frame):
    _received.append(KeyboardInterrupt())
    raise _received[-1]


def stop_received() -> BaseException | None:
    """The exception of the first stop signal since catch_stop_signals, or None."""
    return _received[0] if _received else None


def stop_outcome(stop: BaseException) -> tuple[str, int]:
    """What a stop by Ctrl-C or SIGTERM is called in colocate's last line, and the exit code it ends with."""
    if isinstance(stop, KeyboardInterrupt):
        return "interrupted", EXIT_INTERRUPTED
    assert isinstance(stop, Terminated), stop
    return "stopped (SIGTERM)", EXIT_TERMINATED


def catch_stop_signals():
    """Turn SIGTERM into `Terminated` and SIGINT into KeyboardInterrupt in the main thread (elsewhere: nothing);
    returns the restore function. Python's default for SIGTERM ends the process at once, leaving vLLM's segments
    in /dev/shm."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _received.clear()
    previous = (signal.signal(signal.SIGTERM, _raise_terminated), signal.getsignal(signal.SIGINT))
    mask = take_ctrl_c()
    signal.signal(signal.SIGINT, _raise_interrupt)

    def restore():
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return restore
