"""The chunked log-prob pass (trainer/logprobs.py) against the full logits: the same values, entropy and
gradients, with temperature and top-p, tied and untied heads, chunks that do not divide the tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from colocate.config import TrainerConfig, load_config
from colocate.errors import ConfigError
from colocate.trainer.logprobs import (
    ChunkedLogprobHead,
    install_chunked_head,
    processed_logprobs,
    sequence_logprobs,
)
from colocate.trainer.loss import Sequence, collate


def _model(tied: bool, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float()


def _batch():
    seqs = [Sequence([3, 4, 5], [6, 7, 8, 9, 10], [-1.0] * 5, 0.5), Sequence([11], [12, 13], [-2.0] * 2, -1.0),
            Sequence([14, 15], [16, 17, 18, 19], [-1.5] * 4, 1.0)]
    return collate(seqs, pad_id=0, device=torch.device("cpu"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.8, 0.6), (0.0, 0.9)],
                         ids=["plain", "temperature", "top_p", "greedy"])
@pytest.mark.parametrize("chunk", [1, 4, 1024])
def test_chunked_equals_the_full_logits_in_values_entropy_and_gradients(tied, temperature, top_p, chunk):
    batch = _batch()
    full, chunked = _model(tied), _model(tied)
    install_chunked_head(chunked, chunk)
    assert isinstance(chunked.lm_head, ChunkedLogprobHead)
    assert [n for n, _ in chunked.named_parameters()] == [n for n, _ in full.named_parameters()]  # names kept
    if tied:
        assert chunked.lm_head.weight is chunked.model.embed_tokens.weight

    results = []
    for model in (full, chunked):
        logprobs, entropy = sequence_logprobs(model, batch, temperature=temperature, top_p=top_p)
        loss = (logprobs * batch.target_mask * batch.advantages.unsqueeze(1)).sum()
        loss.backward()
        results.append((logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_full, ent_full, grad_full), (lp_chunk, ent_chunk, grad_chunk) = results
    mask = batch.target_mask.bool()
    torch.testing.assert_close(lp_chunk[mask], lp_full[mask], atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_chunk[mask], ent_full[mask], atol=1e-6, rtol=0)
    for name in grad_full:
        torch.testing.assert_close(grad_chunk[name], grad_full[name], atol=1e-6, rtol=1e-5, msg=name)


def test_entropy_is_that_of_the_sampling_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    _, entropy = processed_logprobs(logits, torch.tensor([0]))
    p = logits.softmax(-1)
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)
    _, uniform = processed_logprobs(torch.zeros(1, 8), torch.tensor([3]))
    assert uniform.item() == pytest.approx(math.log(8), abs=1e-6)
    # top-p keeps the two largest (0.64 + 0.24 > 0.8): the entropy of those two renormalised, finite
    _, nucleus = processed_logprobs(logits, torch.tensor([0]), top_p=0.8)
    q = logits[0, :2].softmax(-1)
    assert nucleus.item() == pytest.approx(-(q * q.log()).sum().item(), abs=1e-6)


def test_the_chunked_head_never_holds_the_full_logits_for_the_backward():
    # what autograd keeps: per chunk its input (hidden states) and output, not the [tokens, vocab] logits
    model = _model(tied=False)
    install_chunked_head(model, 4)
    batch = _batch()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        sequence_logprobs(model, batch, temperature=0.8, top_p=0.6)
    vocab = model.config.vocab_size
    assert not [shape for shape in saved if shape and shape[-1] == vocab and shape.numel() > 4 * vocab]


def test_outside_scoring_the_head_is_lm_head():
    model = _model(tied=False)
    reference = model.lm_head.weight.detach().clone()
    install_chunked_head(model, 8)
    hidden = torch.randn(2, 5, 32)
    torch.testing.assert_close(model.lm_head(hidden), hidden @ reference.T)


def test_chunk_size_zero_or_below_is_refused_and_null_turns_chunking_off():
    for bad in ("0", "-4"):
        with pytest.raises(ConfigError, match=f"trainer.logprob_chunk_tokens={bad} is invalid: must be > 0"):
            load_config(None, [f"trainer.logprob_chunk_tokens={bad}"])
    assert load_config(None, ["trainer.logprob_chunk_tokens=null"]).trainer.logprob_chunk_tokens is None
    assert TrainerConfig().logprob_chunk_tokens == 1024


def test_a_model_that_transforms_its_logits_is_refused_chunking(tmp_path):
    from colocate.job.checks import check_sources

    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gemma2", "final_logit_softcapping": 30.0, "hidden_size": 64, '
                                       '"num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 100}')
    cfg = load_config(None, [f"model.path={model}", f"logging.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as refused:
        check_sources(cfg)
    assert str(refused.value) == (
        "trainer.logprob_chunk_tokens=1024 is invalid: the model transforms its logits after lm_head "
        "(final_logit_softcapping=30.0), which the chunked log-prob pass does not; set "
        "trainer.logprob_chunk_tokens=null")
    check_sources(load_config(None, [f"model.path={model}", "trainer.logprob_chunk_tokens=null",
                                     f"logging.output_dir={tmp_path / 'out'}"]))
