"""SIGTERM becomes `Terminated` in the job's main thread, and a signal's exception that C code wrapped into a
SystemError (what CPython does when the signal lands inside a C call, seen during a Ray call) is still
recognised as the signal, so the job reports a stop (exit 143), not an error."""

from __future__ import annotations

import os
import signal

import pytest

from colocate.host.signals import Terminated, catch_stop_signals
from colocate.job.run import _signal_in_chain


def test_sigterm_raises_terminated_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    restore = catch_stop_signals()
    try:
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.parametrize("signal_exc", [Terminated(), KeyboardInterrupt()])
def test_a_signal_wrapped_by_c_code_is_found_in_the_chain(signal_exc):
    try:
        try:
            raise signal_exc
        except BaseException as inner:
            raise SystemError("<built-in method __new__> returned a result with an exception set") from inner
    except SystemError as wrapped:
        assert _signal_in_chain(wrapped) is signal_exc
    assert _signal_in_chain(ValueError("a real error")) is None


def test_a_stop_signal_is_remembered_whatever_became_of_its_exception():
    # seen under `colocate stop`: SIGTERM inside a C call, the SystemError re-wrapped on the way out with no
    # chain left to follow; the job must still report a stop (exit 143), not an error
    from colocate.host.signals import stop_received

    restore = catch_stop_signals()
    try:
        assert stop_received() is None
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Terminated:
            pass  # swallowed, as a library's `except BaseException` around a C call would
        assert isinstance(stop_received(), Terminated)
    finally:
        restore()
    restore = catch_stop_signals()  # a new job: nothing received yet
    try:
        assert stop_received() is None
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert isinstance(stop_received(), KeyboardInterrupt)
    finally:
        restore()


def test_sigint_raises_keyboard_interrupt_even_when_inherited_ignored_and_blocked():
    # what a job started by `cmd &` from a script (SIG_IGN) or under a Ray daemon (blocked) inherits
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        restore = catch_stop_signals()
        try:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            restore()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, before)
