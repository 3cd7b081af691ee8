"""An fp32 engine with TP=1 and tied embeddings: on CPUs with AVX-512/AMX vLLM would repack linear weights after
loading and a later weight update would fail; with colocate's plain CPU layout every sync lands bit for bit."""

from __future__ import annotations

import pytest

from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import small_job

pytestmark = pytest.mark.e2e


def test_fp32_tp1_tied_engine_syncs_exactly(tmp_path):
    cfg = small_job(tmp_path, "engine.dtype=float32", "engine.tp=1", "placement.num_slots=1",
                    "model.preset=tiny-tied", "sync.verify=full")
    with Runtime(cfg) as rt:
        assert rt.sync.plan.mode == "sliced"
        controller = Controller(cfg, rt)
        for step in range(2):
            controller.step(step)  # sync.verify=full raises on any mismatch
        assert rt.sync.verify_full("float32") == []
