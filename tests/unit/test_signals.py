"""SIGTERM becomes `Terminated` in the job's main thread, and a signal's exception that C code wrapped into a
SystemError (what CPython does when the signal lands inside a C call, seen during a Ray call) is still
recognised as the signal, so the job reports a stop (exit 143), not an error."""

from __future__ import annotations

import os
import signal

import pytest

from colocate.job.run import Terminated, _signal_in_chain, catch_sigterm


def test_sigterm_raises_terminated_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    restore = catch_sigterm()
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
