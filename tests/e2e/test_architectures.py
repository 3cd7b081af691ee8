"""More architectures than the embedded Qwen2: Llama 3, Mistral and Qwen3 (dense; Qwen3-MoE is tiny-moe's), each
a tiny random instance of the public config.json shipped in tests/data/model_configs, shrunk to tiny's size and
the toy vocabulary and otherwise kept (Llama 3's rope scaling, Qwen3's per-head q/k norms, no biases). Each runs
as a user would give it (model.path=DIR) on the default layout (2 trainer ranks, a TP=2 engine): a step trains
and syncs through the reshard plan, not the full-tensor fallback, and every engine tensor then equals the
trainer's through the independent layout oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from tests.e2e.conftest import ROOT, small_job

pytestmark = pytest.mark.e2e

CONFIGS = ROOT / "tests" / "data" / "model_configs"
TINY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, torch_dtype="float32")


def tiny_instance(name: str, out: Path) -> Path:
    """A random model with `name`'s config.json, shrunk, and the toy tasks' character tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from colocate.models.sources import VOCAB, build_tokenizer

    config = json.loads((CONFIGS / name / "config.json").read_text())
    config.update(TINY, vocab_size=len(VOCAB), bos_token_id=VOCAB.index("<bos>"), eos_token_id=VOCAB.index("<eos>"),
                  pad_token_id=VOCAB.index("<pad>"))
    config.pop("quantization_config", None)
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(VOCAB).save_pretrained(out)
    return out


@pytest.mark.parametrize("name, architecture", [
    ("Llama-3.1-8B-Instruct", "LlamaForCausalLM"),
    ("Mistral-7B-Instruct-v0.3", "MistralForCausalLM"),
    ("Qwen3-8B", "Qwen3ForCausalLM"),
])
def test_a_step_syncs_through_the_reshard_plan_exactly(tmp_path, name, architecture):
    model_dir = tiny_instance(name, tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [architecture]
    with Runtime(small_job(tmp_path, f"model.path={model_dir}", "algo.num_steps=1")) as rt:
        assert rt.sync.plan.mode == "sliced"  # a rule for every tensor: no fallback to vLLM's load_weights
        record = Controller(rt.cfg, rt).step(0)
        assert record["sync_mode"] == "sliced" and record["num_trained_sequences"] == 16
        assert rt.sync.verify_full(rt.cfg.engine.dtype) == []
