"""A reasoning-length job through `colocate launch`, as a user with long answers runs it: 2,048-token answers
(rollout.ignore_eos: an untrained model would stop at a random EOS) trained with every long-answer feature on
(activation checkpointing, chunked log-probs, packed sequences under a token budget), on one slot: a trainer rank
and a TP=1 engine (decoding 2,048 tokens at TP=2 took 140 s a step beside the rest of the suite, 50 alone; the
features across ranks and TP=2 are the gloo tests' and the other e2e jobs'). It trains (finite loss and gradients,
weights that move) and every sync is checked in full against the trainer's weights (sync.verify=full)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from colocate.config import ModelConfig
from colocate.models.sources import ensure_model
from tests.e2e.conftest import ROOT, checkpoint_tensors, launch

pytestmark = pytest.mark.e2e

ANSWER = 2048
LONG = [f"rollout.max_tokens={ANSWER}", "rollout.ignore_eos=true", "rollout.num_prompts=1", "rollout.num_samples=4",
        "rollout.reward_fn=tests.e2e.rewards:share_of_a", f"engine.max_model_len={ANSWER + 64}",
        "trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=512", "trainer.pack_sequences=true",
        f"trainer.max_tokens_per_micro_batch={2 * (ANSWER + 64)}", "sync.verify=full", "algo.num_steps=2",
        "placement.num_slots=1", "engine.tp=1", "logging.progress=false"]


def test_2048_token_answers_train_with_every_long_answer_feature(tmp_path):
    result = launch(tmp_path, *LONG, timeout_s=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    startup = records[0]
    assert startup["event"] == "startup"
    assert all(t["attention"] == "sdpa" for t in startup["trainers"])  # packed rows: transformers' packed mask
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1]  # step 1 generates with the weights step 0 trained and synced
    for record in steps:
        assert record["response_len_mean"] == ANSWER and record["num_response_tokens"] == 4 * ANSWER
        assert math.isfinite(record["loss"]) and 0 < record["grad_norm"] < math.inf
        assert math.isfinite(record["entropy"]) and record["entropy"] > 0
        # behaviour logprobs from the engine against the trainer's, over all 8,192 tokens: the synced weights
        assert record["mismatch_monitor"]["token"]["count"] == 4 * ANSWER and record["mismatch"] < 0.05
    # the weights moved: the final checkpoint against the model the job started from
    start = load_file(f"{ensure_model(ModelConfig(cache_dir=str(ROOT / '.cache' / 'models')))}/model.safetensors")
    [final] = (tmp_path / "out" / "checkpoints").iterdir()
    trained = {k: v for k, v in checkpoint_tensors(final).items() if not k.startswith("optimizer.")}
    moved = [name for name, before in start.items()
             if not torch.equal(before, next(v for k, v in trained.items() if k.endswith(name)))]
    assert len(moved) == len(start), sorted(set(start) - set(moved))
