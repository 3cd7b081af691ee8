"""A GPU node's requirements beyond GPU memory (colocate/host/node_checks.py), each refused in one line naming what
to change, and only where the job's placement needs it; the readings (NVML's compute modes, the MPS pipe,
/dev/shm, MemAvailable) are passed in. The readers themselves run against what they read: NVML through a fake
module (the one boundary a CPU machine cannot provide), the MPS pipe as a real socket and FIFO."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import types

import pytest

from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.host.node_checks import (
    GIB,
    check_node,
    compute_modes,
    host_needs,
    mps_daemon_listens,
    mps_pipe_directory,
    shm_free_bytes,
    visible_gpus,
)
from colocate.job.preflight import model_dims
from tests.unit.test_preflight import QWEN_7B

CFG = load_config(None, [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2"])
SPLIT = load_config(None, [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2", "placement.engine_slots=4"])
SPLIT_RM = load_config(None, [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2",
                              "placement.engine_slots=4", "rollout.rewards=model:tiny-rm"])
HOST = host_needs(CFG, model_dims(CFG), offload=False)
GOOD = dict(available_host_bytes=1000 * GIB, shm_bytes=32 * GIB, modes={i: "Default" for i in range(8)}, mps=None)
EXCLUSIVE = {**{i: "Default" for i in range(8)}, 1: "Exclusive_Process"}
UUIDS = ["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-8932aa00-0000-0000-0000-000000000000",
         "GPU-1234abcd-0000-0000-0000-000000000000"]


def test_every_rank_loads_the_fp32_checkpoint_and_an_offloading_trainer_keeps_a_host_copy():
    assert HOST == {"checkpoint loaded in fp32 by every rank (start-up)": 8 * 4 * 7_615_616_512}
    offloading = host_needs(CFG, model_dims(CFG), offload=True)
    assert offloading["trainer state's host copy (offload)"] == 12 * 7_615_616_512


def test_a_good_node_passes():
    check_node(CFG, HOST, **GOOD)
    check_node(CFG, HOST, **{**GOOD, "modes": None})  # NVML unreadable: nothing to refuse


@pytest.mark.parametrize("reading, message", [
    pytest.param({"modes": EXCLUSIVE}, r"GPU compute mode GPU 1: Exclusive_Process: a trainer rank and an engine "
                 r"worker share each GPU .* needs mode Default \(nvidia-smi -c DEFAULT\)", id="exclusive_process"),
    pytest.param({"modes": {0: "Default", 3: "Prohibited"}}, r"GPU compute mode GPU 3: Prohibited: no process can "
                 r"use it; set mode Default \(nvidia-smi -i 3 -c DEFAULT\)", id="prohibited"),
    pytest.param({"mps": "/tmp/nvidia-mps"}, r"an MPS control daemon runs \(/tmp/nvidia-mps/control\)", id="mps"),
    pytest.param({"shm_bytes": 64 << 20}, r"/dev/shm has 0.06 GiB free, .* --ipc=host or --shm-size=16g",
                 id="docker_default_shm"),
    pytest.param({"available_host_bytes": 200 * GIB},
                 r"host memory: the job needs 227.0 GiB on this node \(checkpoint loaded in fp32 by every rank "
                 r"\(start-up\)\) but 200.0 GiB is available; use fewer ranks per node \(placement.num_slots, now 8\)",
                 id="host_ram"),
])
def test_a_missing_requirement_is_refused_in_one_line(reading, message):
    with pytest.raises(ConfigError, match=message) as caught:
        check_node(CFG, HOST, **{**GOOD, **reading})
    assert "\n" not in str(caught.value)


def test_an_exclusive_gpu_is_refused_only_where_two_processes_of_the_job_share_it():
    """Exclusive_Process admits one context per GPU: a split placement has one process per GPU, unless its reward
    model shares the engines' GPUs; Prohibited admits none, in every placement."""
    check_node(SPLIT, HOST, **{**GOOD, "modes": EXCLUSIVE})
    check_node(SPLIT, HOST, **{**GOOD, "modes": {**EXCLUSIVE, 2: "Exclusive_Thread"}})
    with pytest.raises(ConfigError, match="GPU 1: Exclusive_Process: the reward model's workers share the first "
                                          "engine GPUs"):
        check_node(SPLIT_RM, HOST, **{**GOOD, "modes": EXCLUSIVE})
    with pytest.raises(ConfigError, match="GPU 5: Prohibited"):
        check_node(SPLIT, HOST, **{**GOOD, "modes": {5: "Prohibited"}})


@pytest.mark.parametrize("value, visible", [
    pytest.param(None, [0, 1, 2], id="unset_every_gpu"),
    pytest.param("", [], id="empty_none"),
    pytest.param("2,0", [2, 0], id="indices_in_their_order"),
    pytest.param("0,2,-1,1", [0, 2], id="ends_at_an_invalid_entry"),
    pytest.param("0,7,1", [0], id="ends_at_a_missing_index"),
    pytest.param("GPU-1234abcd-0000-0000-0000-000000000000", [2], id="full_uuid"),
    pytest.param("GPU-1234, GPU-8932f", [2, 0], id="unique_prefixes"),
    pytest.param("GPU-8932,1", [], id="ambiguous_prefix_names_none"),
    pytest.param("MIG-GPU-1234abcd-0000-0000-0000-000000000000/1/0", [2], id="mig_pre_r470"),
    pytest.param("MIG-aaaa,MIG-bbbb,MIG-cccc", [1], id="mig_devices_of_one_gpu"),
    pytest.param("MIG-ffff,0", [], id="unknown_mig"),
])
def test_the_gpus_cuda_sees_under_cuda_visible_devices(value, visible):
    assert visible_gpus(value, UUIDS, {"MIG-aaaa": 1, "MIG-bbbb": 1, "MIG-cccc": 1}) == visible


class _FakeNvml(types.ModuleType):
    """pynvml's calls node_checks makes, over three GPUs of these modes (the GPUs a CPU machine does not have)."""
    NVMLError = RuntimeError

    def __init__(self, modes, mig: dict[int, list[str | None]]):
        super().__init__("pynvml")
        self.modes, self.mig, self.shut = modes, mig, False

    def nvmlInit(self):
        self.shut = False

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.modes)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        if isinstance(handle, tuple):  # a MIG device's handle
            return self.mig[handle[0]][handle[1]]
        return UUIDS[handle].encode() if handle == 0 else UUIDS[handle]  # older pynvml returns bytes

    def nvmlDeviceGetComputeMode(self, handle):
        return self.modes[handle]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle):
        if handle not in self.mig:
            raise self.NVMLError("Not Supported")
        return len(self.mig[handle])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle, index):
        if self.mig[handle][index] is None:
            raise self.NVMLError("Not Found")  # a slot with no MIG device in it
        return handle, index


def test_compute_modes_reads_the_visible_gpus_only(monkeypatch):
    fake = _FakeNvml([0, 3, 2], mig={2: [None, "MIG-5e1f"]})  # Default, Exclusive_Process, Prohibited
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert compute_modes() == {0: "Default", 1: "Exclusive_Process", 2: "Prohibited"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8932f,GPU-8932a")  # the job's GPUs: not the prohibited one
    assert compute_modes() == {0: "Default", 1: "Exclusive_Process"} and fake.shut
    check_node(SPLIT, HOST, **{**GOOD, "modes": compute_modes()})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5e1f")  # a MIG device: its GPU's mode
    assert compute_modes() == {2: "Prohibited"}


def test_an_mps_pipe_counts_only_when_a_daemon_answers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    control = tmp_path / "control"
    assert mps_pipe_directory() is None  # no pipe
    control.touch()
    assert mps_pipe_directory() is None  # a plain file: nobody behind it
    control.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(control))
        server.listen(1)
        assert mps_pipe_directory() == tmp_path  # a daemon listening on its socket
    assert control.exists() and mps_pipe_directory() is None  # the socket file a stopped daemon left behind
    control.unlink()
    os.mkfifo(control)
    assert not mps_daemon_listens(control)  # a FIFO with no reader
    reader = threading.Thread(target=lambda: os.close(os.open(control, os.O_RDONLY)), daemon=True)
    reader.start()  # a daemon's read end: its open blocks until a writer comes
    listened = False
    for _ in range(500):
        if mps_daemon_listens(control):  # the probe's open is that writer: the reader returns
            listened = True
            break
        time.sleep(0.01)
    reader.join(timeout=10)
    if reader.is_alive():  # the probe never reached it: release it (O_RDWR opens a FIFO at once)
        os.close(os.open(control, os.O_RDWR))
    assert listened and not reader.is_alive()


def test_shm_is_read_from_this_machine():
    assert shm_free_bytes() > 0
