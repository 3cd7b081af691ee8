"""Memory preflight: predicted phase peaks from the config, and one clear line when a phase cannot fit."""

from __future__ import annotations

import pytest

from colocate.config import ConfigError, load_config
from colocate.preflight import GIB, check_environment, check_fits, model_dims, predict_phases


def phases(*overrides):
    cfg = load_config(None, list(overrides))
    return cfg, {p.name: p for p in predict_phases(cfg, model_dims(cfg), device="cpu")}


def test_default_job_fits_this_machine():
    cfg, by_name = phases()
    check_fits(list(by_name.values()), available_bytes=16 * GIB, cfg=cfg, device="cpu")
    assert set(by_name) == {"startup", "rollout", "train", "sync"}


def test_kv_cache_larger_than_memory_names_phase_shortfall_and_key():
    cfg, by_name = phases("engine.kv_cache_gib=64")
    with pytest.raises(ConfigError) as err:
        check_fits(list(by_name.values()), available_bytes=16 * GIB, cfg=cfg, device="cpu")
    message = str(err.value)
    assert "phase 'rollout'" in message and "short by" in message and "engine.kv_cache_gib (now 64.0)" in message
    assert "\n" not in message


def test_sleep_level_1_keeps_a_host_copy_during_training():
    _, level2 = phases("model.preset=bench", "engine.sleep_level=2")
    _, level1 = phases("model.preset=bench", "engine.sleep_level=1")
    extra = level1["train"].total - level2["train"].total
    assert 0.5e9 < extra < 0.7e9  # the bench preset's ~0.6 GB of bf16 weights


def test_bigger_model_predicts_more_everywhere():
    _, tiny = phases()
    _, bench = phases("model.preset=bench")
    assert all(bench[name].total > tiny[name].total for name in tiny)


def test_expandable_segments_trap_is_refused_on_cuda(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ConfigError, match="PYTORCH_CUDA_ALLOC_CONF"):
        check_environment("cuda")
    check_environment("cpu")  # irrelevant without CUDA
