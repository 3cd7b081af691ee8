"""A multiprocessing child with the fast exit (colocate/engine/worker_exit.py) keeps the exit code and the atexit
callbacks the usual way out gives it, for each way its run can end."""

from __future__ import annotations

import atexit
import multiprocessing

import pytest

from colocate.engine.worker_exit import exit_without_finalization


def _child(how: str, marker: str) -> None:
    exit_without_finalization()
    atexit.register(lambda: open(marker, "w").write("atexit ran"))
    if how == "raise":
        raise ValueError("a failed worker")
    if how == "exit3":
        raise SystemExit(3)


@pytest.mark.parametrize("how, code", [("return", 0), ("raise", 1), ("exit3", 3)])
def test_the_exit_code_and_atexit_callbacks_are_kept(tmp_path, how, code):
    marker = tmp_path / "marker"
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(how, str(marker)))
    child.start()
    child.join(60)
    assert child.exitcode == code
    assert marker.read_text() == "atexit ran"


def test_only_a_multiprocessing_child_is_changed():
    before = multiprocessing.util._exit_function
    exit_without_finalization()  # this pytest process is nobody's child
    assert multiprocessing.util._exit_function is before
