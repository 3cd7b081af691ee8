"""The preflight's parameter count of every model whose public config.json ships in tests/data/model_configs
(Qwen2.5, Qwen3 dense and MoE, Llama 3.1, Mistral) equals the count of the model transformers builds from that
config (on the meta device: no memory, no weights): the memory preflight plans with the real size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from colocate.job.preflight import ModelDims

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"


@pytest.mark.parametrize("name", sorted(p.name for p in MODEL_CONFIGS.iterdir()))
def test_preflight_counts_what_transformers_builds(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((MODEL_CONFIGS / name / "config.json").read_text())
    config = AutoConfig.from_pretrained(MODEL_CONFIGS / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelDims.from_config_dict(config_dict).num_params == sum(p.numel() for p in model.parameters())
