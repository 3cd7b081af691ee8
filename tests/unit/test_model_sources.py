"""The embedded model: builds once, loads in transformers, tokenizes characters, presets are well-formed."""

from __future__ import annotations

import pytest
import torch

from colocate.config import ModelConfig
from colocate.models.sources import PRESETS, VOCAB, ensure_model, load_tokenizer, preset_dir


def test_tiny_builds_once_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(preset="tiny", cache_dir=str(tmp_path))
    path = ensure_model(cfg)
    mtime = (preset_dir(cfg) / "model.safetensors").stat().st_mtime
    assert ensure_model(cfg) == path and (preset_dir(cfg) / "model.safetensors").stat().st_mtime == mtime
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    out = model(input_ids=torch.tensor([[5, 6, 7]]))
    assert out.logits.shape == (1, 3, len(VOCAB))
    assert not [p for p in tmp_path.glob(".qwen2-tiny-*") if p.is_dir()]  # no half-built model left


def test_character_tokenizer_round_trips(tmp_path):
    tokenizer = load_tokenizer(ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path))))
    ids = tokenizer("12+3 =ab", add_special_tokens=False).input_ids
    assert len(ids) == 8 and tokenizer.decode(ids) == "12+3 =ab"
    assert tokenizer.eos_token_id == VOCAB.index("<eos>")


def test_bench_preset_is_big_enough_for_benchmarks():
    p = PRESETS["bench"]
    per_layer = (p.hidden_size * p.hidden_size * 2 + 2 * p.hidden_size * p.num_key_value_heads * p.head_dim
                 + 3 * p.hidden_size * p.intermediate_size)
    total = p.num_layers * per_layer + 2 * p.vocab_size * p.hidden_size
    assert p.num_layers >= 24 and total * 2 >= 0.4e9
    assert all(pr.head_dim in (32, 64, 80, 96, 112, 128) for pr in PRESETS.values())  # vLLM CPU attention


def test_a_hub_id_that_cannot_be_fetched_is_one_line_naming_model_path(monkeypatch, tmp_path):
    from colocate.config import ModelConfig
    from colocate.errors import ConfigError
    from colocate.models.sources import ensure_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the hub answers at once that it cannot
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ConfigError) as error:
        ensure_model(ModelConfig(path="no-such-org/no-such-model"))
    message = str(error.value)
    assert message.startswith("model.path='no-such-org/no-such-model' is invalid") and "\n" not in message


def test_a_local_directory_is_used_as_is(tmp_path):
    from colocate.config import ModelConfig
    from colocate.models.sources import ensure_model

    assert ensure_model(ModelConfig(path=str(tmp_path))) == str(tmp_path)


def test_tiny_chat_writes_tool_calls_and_the_toy_presets_keep_their_cache(tmp_path):
    """tiny-chat's vocabulary holds every character of a tool call (the toy one lacks <, {, "); adding the
    characters field left the toy presets' cache directories where they were (no rebuild after an upgrade)."""
    path = ensure_model(ModelConfig(preset="tiny-chat", cache_dir=str(tmp_path)))
    tokenizer = load_tokenizer(path)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "(1+2)*3"}}</tool_call>\nOK!'
    ids = tokenizer(call, add_special_tokens=False).input_ids
    assert len(ids) == len(call) and tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == call
    assert tokenizer.eos_token_id == VOCAB.index("<eos>")
    assert preset_dir(ModelConfig(preset="tiny", cache_dir="/c")).name == "qwen2-tiny-fa104fde-seed0"


def test_the_reward_preset_is_a_one_label_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from colocate.models.sources import ensure_reward_model

    path = ensure_reward_model("model", "tiny-rm", cache_dir=str(tmp_path), seed=0)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert model.config.architectures == ["Qwen2ForSequenceClassification"] and model.config.num_labels == 1
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 1)
    assert ensure_reward_model("judge", "tiny", cache_dir=str(tmp_path), seed=0) == \
        ensure_model(ModelConfig(preset="tiny", cache_dir=str(tmp_path)))  # a judge may be a causal preset
