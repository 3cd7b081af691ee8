"""scripts/gpu_check.py in its CPU mode: every section whose path the CPU has runs here, through the same
functions the lent GPU runs (colocate/bench/gpu_check/), so a changed product signature fails CI, not the next
GPU run. The first GPU run met exactly that: `fsdp2_nccl` called `TrainerActor.train_step` without `step` and
`num_seqs_all_ranks`, and its CPU twin skipped the section, so CI never saw it. Here that section must pass.

One run of the script (about 50 s on 2 cores) serves every test of the module."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.bench.gpu_check.common import fit_line
from colocate.bench.gpu_check.run import CPU_TWINS, CUDA_ONLY
from colocate.bench.gpu_check.sync_steady import Shape, engine_params, hf_shapes
from colocate.sync.tp_layout import TPLayout
from tests.unit.test_reshard import H, HD, INTER, NKV, NQ, engine_shapes, hf_state

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    return json.loads(out.read_text())


def test_every_section_with_a_cpu_twin_passes_and_the_cuda_only_ones_say_why(report):
    sections = report["sections"]
    assert set(sections) == set(CPU_TWINS) | set(CUDA_ONLY)
    failed = {k: sections[k].get("error") or sections[k]["status"] for k in CPU_TWINS
              if sections[k]["status"] != "pass"}
    assert failed == {}
    assert {k: sections[k]["status"] for k in CUDA_ONLY} == CUDA_ONLY
    assert all(sections[k]["reason"] for k in CUDA_ONLY)
    assert report["passed"] and {"command", "config", "started_at", "total_seconds"} <= report.keys()
    assert all({"status", "seconds"} <= s.keys() for s in sections.values())


def test_the_fsdp2_twin_trains_offloads_and_writes_through_trainer_actor_on_gloo(report):
    """The section the stale `train_step` call broke: TrainerActor's steps, offload/onload and ring write."""
    fsdp2 = report["sections"]["fsdp2"]
    got = fsdp2["auto"]
    assert fsdp2["process_group"] == "gloo" and got["offloader"] == "file"
    assert len(got["losses"]) == 3 and all(math.isfinite(x) for x in got["losses"] + [got["loss_after_onload"]])
    assert got["bit_exact"] and got["storages_released"] and got["ring_mismatches"] == [] and got["ring_buckets"]
    assert got["offloaded_bytes"] == got["onloaded_bytes"] == got["state_bytes"] > 0


def test_the_ring_protocol_runs_bit_exact_over_shared_memory(report):
    ring = report["sections"]["ring_ipc"]
    assert ring["bit_exact"] and ring["checksum_mismatches"] == 0 and ring["transport"] == "shm"
    assert ring["bytes"] == ring["num_buckets"] * ring["slot_bytes"] and ring["ratio"] > 0


def test_offload_moves_and_restores_the_state_before_and_after_the_optimizer_state_exists(report):
    offload = report["sections"]["offload"]
    file_tier = offload["file"]
    assert all(r["bit_exact"] and r["offloaded_bytes"] == r["onloaded_bytes"] for r in file_tier["rounds"])
    before = offload["file_before_optimizer_state"]
    assert before["params_offloaded"] == before["params_bytes"] < before["state_bytes"]  # AdamW's moments came
    assert all(r["offloaded"] == r["onloaded"] == before["state_bytes"] for r in before["rounds"])


def test_steady_sync_fits_a_per_bucket_cost_and_a_bandwidth_at_both_sizes(report):
    sync = report["sections"]["steady_sync"]
    for key in ("bench", "7b_layer"):
        shape = sync[key]
        assert shape["bit_exact"]
        buckets = [r["num_buckets"] for r in shape["runs"]]
        assert buckets == sorted(buckets, reverse=True) and buckets[0] > buckets[-1]  # larger slots, fewer buckets
        assert all(r["ratio_to_cast_floor"] > 0 and len(r["buckets"]) == r["num_buckets"] for r in shape["runs"])
        assert {"per_bucket_s", "s_per_byte", "bandwidth_gb_s"} == set(shape["fit"])


def test_train_step_holds_colocate_against_the_preflight_and_a_plain_step(report):
    train = report["sections"]["train_step"]
    assert [r["tokens"] for r in train["table"]] == train["lengths"]
    for row in train["table"]:
        assert row["colocate_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0 and row["colocate_mfu"] > 0
        assert row["predicted"]["resident_bytes"] > 0 and row["measured"]["state_bytes"] > 0
        assert row["measured"]["optimizer_over_resident"] > 0  # the optimizer step's own peak, apart
    for side in ("colocate", "plain"):
        profile = train[side]["profile"]
        assert profile["top_ops"] and profile["copy_calls"] >= sum(c["calls"] for c in profile["copies_by_source"]) > 0


def test_fresh_pages_and_node_checks_record_what_they_read(report):
    pages = report["sections"]["fresh_pages"]["portable_sleep"]
    assert pages["released_bytes"] == pages["restored_bytes"] == pages["bytes"]
    assert math.isclose(sum(pages[k] for k in ("kept", "zero", "marker", "other")), 1.0)
    verdicts = report["sections"]["node_checks"]["verdicts"]
    assert set(verdicts) == {"colocated", "split", "environment"}


def test_a_line_fit_recovers_a_per_call_cost_and_a_per_byte_cost():
    points = [(x, 3e-3 + 2e-9 * x) for x in (1 << 20, 4 << 20, 16 << 20)]
    a, b = fit_line(points)
    assert math.isclose(a, 3e-3, rel_tol=1e-6) and math.isclose(b, 2e-9, rel_tol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_checks_engine_layout_is_the_one_the_reshard_tests_know(tp):
    """steady_sync has no vLLM to report the engine's parameters: the oracle's shapes must match the ones the
    reshard tests build by hand (fused qkv and gate_up, the vocabulary padded then split)."""
    vocab = 49
    hf = hf_state(vocab, tied=False, num_layers=2)
    assert {n: tuple(t.shape) for n, t in hf.items()} == hf_shapes(Shape(H, INTER, NQ, NKV, vocab, 2))
    for rank in range(tp):
        layout = TPLayout(rank, tp, NQ, NKV, HD, vocab)
        ours = {n: s for n, s, _ in engine_params({n: tuple(t.shape) for n, t in hf.items()}, layout)}
        assert ours == dict(engine_shapes(hf, layout, False))
