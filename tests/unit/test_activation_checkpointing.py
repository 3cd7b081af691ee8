"""Activation checkpointing per decoder layer (trainer/fsdp.py checkpoint_layers): the same gradients as without,
the parameters' names kept, and a model class that cannot checkpoint refused before any actor starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.trainer.fsdp import checkpoint_layers
from colocate.trainer.logprobs import install_chunked_head, sequence_logprobs
from colocate.trainer.loss import Sequence, collate


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float().train()


def _gradients(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    seqs = [Sequence([3, 4, 5], [6, 7, 8, 9], [-1.0] * 4, 0.5), Sequence([11], [12, 13], [-2.0] * 2, -1.0)]
    batch = collate(seqs, pad_id=0, device=torch.device("cpu"))  # padded: the mask goes through the recompute
    logprobs, _ = sequence_logprobs(model, batch, temperature=0.9, top_p=1.0)
    (logprobs * batch.target_mask * batch.advantages.unsqueeze(1)).sum().backward()
    return logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunked", [False, True], ids=["full_logits", "chunked_logits"])
def test_checkpointed_gradients_equal_the_plain_ones_bitwise(chunked):
    plain, checkpointed = _model(), _model()
    if chunked:
        install_chunked_head(plain, 3)
        install_chunked_head(checkpointed, 3)
    checkpoint_layers(checkpointed)
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    (lp_plain, grads_plain), (lp_checkpointed, grads_checkpointed) = _gradients(plain), _gradients(checkpointed)
    assert torch.equal(lp_plain, lp_checkpointed)
    for name, grad in grads_plain.items():
        assert torch.equal(grads_checkpointed[name], grad), name  # the recompute repeats the same CPU kernels


def test_the_backward_keeps_only_each_layers_input():
    # what autograd saves outside the checkpointed layers: no per-layer attention or MLP activations
    saved = []
    for model in (_model(), _model()):
        if saved:
            checkpoint_layers(model)
        shapes = []
        ids = torch.randint(0, 97, (1, 16))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
            model(input_ids=ids).logits.sum()
        saved.append(shapes)
    plain, checkpointed = saved
    intermediate = [s for s in plain if s and s[-1] == 64]  # MLP activations: intermediate_size wide
    assert intermediate and not [s for s in checkpointed if s and s[-1] == 64]


def test_a_model_that_cannot_checkpoint_is_refused_before_any_actor(tmp_path, monkeypatch):
    from colocate.job.checks import check_sources

    model = tmp_path / "model"
    model.mkdir()
    qwen = Path(__file__).parents[1] / "data" / "model_configs" / "Qwen2.5-0.5B-Instruct" / "config.json"
    (model / "config.json").write_text(qwen.read_text())  # Qwen2ForCausalLM's, with the dimensions checks read
    overrides = [f"model.path={model}", f"logging.output_dir={tmp_path / 'out'}"]
    check_sources(load_config(None, [*overrides, "trainer.activation_checkpointing=true"]))
    monkeypatch.setattr(Qwen2ForCausalLM, "supports_gradient_checkpointing", False)
    with pytest.raises(ConfigError) as refused:
        check_sources(load_config(None, [*overrides, "trainer.activation_checkpointing=true"]))
    assert str(refused.value) == (
        "trainer.activation_checkpointing=True is invalid: Qwen2ForCausalLM cannot checkpoint its layers "
        "(transformers' supports_gradient_checkpointing is False); set trainer.activation_checkpointing=false")
    with pytest.raises(ValueError, match="Qwen2ForCausalLM cannot checkpoint its layers"):
        checkpoint_layers(_model())


def test_activation_offload_needs_checkpointing():
    with pytest.raises(ConfigError, match="trainer.activation_offload=True is invalid: .* needs "
                                          "trainer.activation_checkpointing=true"):
        load_config(None, ["trainer.activation_offload=true"])
    assert load_config(None, ["trainer.activation_offload=true",
                              "trainer.activation_checkpointing=true"]).trainer.activation_offload
