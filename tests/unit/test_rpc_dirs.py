"""vLLM's socket directories (colocate/host/rpc_dirs.py): one per engine, named by its pid; a dead engine's goes,
a living one's and anything not ours stay."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from colocate.host.rpc_dirs import PREFIX, create_rpc_dir, remove_stale_rpc_dirs


def test_a_dead_engines_directory_is_removed_and_a_living_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = Path(create_rpc_dir())  # this process: alive
    assert mine.name.startswith(f"{PREFIX}{os.getpid()}-") and oct(mine.stat().st_mode & 0o777) == "0o700"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{PREFIX}{int(dead.stdout)}-abc"
    gone.mkdir()
    (gone / "socket-file").write_text("")  # what vLLM binds there and never unlinks
    unnamed = tmp_path / f"{PREFIX}notapid"  # not a name this module gives: left alone
    unnamed.mkdir()
    assert remove_stale_rpc_dirs() == [str(gone)]
    assert mine.is_dir() and unnamed.is_dir() and not gone.exists()
    assert remove_stale_rpc_dirs() == []
