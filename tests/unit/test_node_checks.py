"""A GPU node's requirements beyond GPU memory (colocate/host/node_checks.py), each refused in one line naming what
to change; the readings (NVML's compute modes, the MPS pipe, /dev/shm, MemAvailable) are passed in."""

from __future__ import annotations

import pytest

from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.host.node_checks import GIB, check_node, host_needs, mps_pipe_directory, shm_free_bytes
from colocate.job.preflight import model_dims
from tests.unit.test_preflight import QWEN_7B

CFG = load_config(None, [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2"])
HOST = host_needs(CFG, model_dims(CFG), offload=False)
GOOD = dict(available_host_bytes=1000 * GIB, shm_bytes=32 * GIB, modes=["Default"] * 8, mps=None)


def test_every_rank_loads_the_fp32_checkpoint_and_an_offloading_trainer_keeps_a_host_copy():
    assert HOST == {"checkpoint loaded in fp32 by every rank (start-up)": 8 * 4 * 7_615_616_512}
    offloading = host_needs(CFG, model_dims(CFG), offload=True)
    assert offloading["trainer state's host copy (offload)"] == 12 * 7_615_616_512


def test_a_good_node_passes():
    check_node(CFG, HOST, **GOOD)
    check_node(CFG, HOST, **{**GOOD, "modes": None})  # NVML unreadable: nothing to refuse


@pytest.mark.parametrize("reading, message", [
    pytest.param({"modes": ["Default", "Exclusive_Process"] + ["Default"] * 6},
                 "GPU compute mode GPU 1: Exclusive_Process: .* needs mode Default", id="exclusive_process"),
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


def test_the_readings_of_this_machine(tmp_path, monkeypatch):
    assert shm_free_bytes() > 0
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert mps_pipe_directory() is None
    (tmp_path / "control").touch()
    assert mps_pipe_directory() == tmp_path
