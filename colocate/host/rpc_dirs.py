"""Directories for vLLM's IPC sockets: one per engine, named by the engine actor's pid.

vLLM binds its ZMQ IPC sockets under $VLLM_RPC_BASE_PATH (vllm/utils/network_utils.py get_open_zmq_ipc_path,
/tmp by default) and never unlinks them: a few files per engine start, thousands left in /tmp on a CI machine.
Each engine gets a directory of its own (0700: mkdtemp), removed when it shuts down (EngineActor.shutdown). A
SIGKILLed engine cannot remove it; the pid in the name lets whoever comes next see its owner is gone: every
job's start and close (Runtime), and `colocate clean`.

Hazard: as with the segment names (host/shm.py), a pid is only meaningful in this pid namespace:
containers sharing /tmp but not pids must not share a uid. A pid reused since only keeps a dead engine's
directory until that process is gone too.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from colocate.host.procfs import pid_alive

PREFIX = "colocate-vllm-rpc-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def create_rpc_dir() -> str:
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove_stale_rpc_dirs(root: str | None = None) -> list[str]:
    """Remove this user's engine socket directories whose engine process is gone; returns their paths."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        try:
            ours = path.is_dir() and path.lstat().st_uid == os.getuid()
        except OSError:  # removed meanwhile by its engine
            continue
        if match and ours and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed

