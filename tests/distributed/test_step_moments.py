"""The train step's memory model (trainer/step_moments.py) against a real train step: a TrainerActor rank on gloo
runs one step under torch's MemTracker (every storage an op returns, counted until it is freed: what CUDA's
allocator counts as allocated, without its caching), and the peaks of its forward+backward and of AdamW's step,
each over the resident state, are the model's within 8%. World size 1 and 2, bf16 and fp32, checkpointed and not,
chunked and not, an fp32 head under bf16, and a step of two micro-batches (the second beside every gradient)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import run_distributed

CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False)
TOLERANCE = 0.08


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("moments")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**CONFIG, max_position_embeddings=4096)).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _sequence(length: int, k: int):
    from colocate.rl.samples import Sequence

    prompt, answer = 64, length - 64
    return Sequence([5 + (i + k) % 100 for i in range(prompt)], [6 + (i * 7 + k) % 8000 for i in range(answer)],
                    [-2.0] * answer, 1.0 if k % 2 == 0 else -1.0)


def _measured_step(rank: int, world_size: int, port: int, model_path: str, keys: dict, length: int,
                   micro_batches: int) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from colocate.config import TrainerConfig
    from colocate.models.dims import ModelDims
    from colocate.trainer.actor import TrainerActor
    from colocate.trainer.step_moments import StepSetting, optimizer_step_parts, peak_moment, step_moments

    cfg = TrainerConfig(micro_batch_size=1, num_threads=1, **keys)
    trainer = TrainerActor(rank, world_size, cfg, model_path, device="cpu", pad_id=0)
    trainer.setup("127.0.0.1", port)
    trainer._create_optimizer_state()  # resident before the step, as after a first one
    cpu = torch.device("cpu")
    tracker, readings = MemTracker(), {}

    def before_optimizer(*_):  # the forward+backward's peak; the optimizer step's from here
        readings["forward_backward"] = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - readings["resident"]
        tracker._peak_mem = {cpu: 0}

    trainer.optimizer.register_step_pre_hook(before_optimizer)
    seqs = [_sequence(length, k) for k in range(micro_batches * world_size)][rank::world_size]
    tracker.track_external(trainer.model, trainer.optimizer)
    # MemTracker refuses a module's second forward in one context (a step of two micro-batches runs two): its
    # per-module statistics, which this test does not read, start again instead
    pre_forward = tracker._pre_fw_hook

    def again(module, inputs):
        try:
            return pre_forward(module, inputs)
        except NotImplementedError:
            tracker.reset_mod_stats()
            return pre_forward(module, inputs)

    tracker._pre_fw_hook = again
    with tracker:
        readings["resident"] = tracker.get_tracker_snapshot()[cpu]["Total"]
        trainer.train_step(seqs, step=1, num_tokens_all_ranks=micro_batches * world_size * (length - 64),
                           num_micro_batches=micro_batches, num_seqs_all_ranks=micro_batches * world_size)
        optimizer = tracker.get_tracker_snapshot("peak")[cpu]["Total"] - readings["resident"]
    trainer.shutdown()

    dims = ModelDims.from_config_dict({**CONFIG, "model_type": "qwen2"})
    setting = StepSetting(compute_bytes=2 if cfg.mixed_precision else 4, temperature=1.0, top_p=1.0,
                          chunk_tokens=cfg.logprob_chunk_tokens, checkpointed=cfg.activation_checkpointing,
                          world_size=world_size, device="cpu", fp32_head=cfg.fp32_lm_head)
    steps = [step_moments(dims, setting, rows=1, length=length, masked=False, accumulating=i > 0)
             for i in range(micro_batches)]
    predicted = max(sum(peak_moment(m)[1].values()) for m in steps)
    measured = readings["forward_backward"]
    assert abs(measured / predicted - 1) <= TOLERANCE, (measured, predicted, peak_moment(steps[-1]))
    predicted_optimizer = sum(optimizer_step_parts(dims, setting).values())
    assert abs(optimizer / predicted_optimizer - 1) <= TOLERANCE, (optimizer, predicted_optimizer)


@pytest.mark.parametrize("world_size, keys, length, micro_batches", [
    (1, dict(mixed_precision=True, activation_checkpointing=True, logprob_chunk_tokens=256), 1024, 1),
    (1, dict(mixed_precision=False, activation_checkpointing=False, logprob_chunk_tokens=None), 512, 1),
    (1, dict(mixed_precision=True, activation_checkpointing=True, logprob_chunk_tokens=256), 512, 2),
    (2, dict(mixed_precision=True, activation_checkpointing=False, logprob_chunk_tokens=256), 512, 1),
    # trainer.fp32_lm_head: fp32 logits from an fp32 copy of the head, and that copy's gradient in the backward
    (1, dict(mixed_precision=True, activation_checkpointing=True, logprob_chunk_tokens=256, fp32_lm_head=True),
     1024, 1),
], ids=["bf16_checkpointed_chunked", "fp32_full_logits", "two_micro_batches", "world_2", "fp32_head"])
def test_a_train_step_holds_what_its_moments_say(model_path, world_size, keys, length, micro_batches):
    run_distributed(_measured_step, model_path, keys, length, micro_batches, world_size=world_size, init=False)
