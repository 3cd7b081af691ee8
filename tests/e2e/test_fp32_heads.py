"""fp32 heads on both sides of a bf16 job (engine.fp32_lm_head through vLLM's head_dtype, trainer.fp32_lm_head under
bf16 mixed precision): each side reports fp32 logits from the model it runs, the job trains and syncs exactly (the
weights stay bf16 on the engine), and the chapter's measurement (bench/mismatch.py) keeps every token within the
monitor's band."""

from __future__ import annotations

import math

import pytest
import ray

from colocate.bench.consistency import _prefill, _sample, compare
from colocate.bench.mismatch import BAND, _measure, score
from colocate.host.devices import cpu_bf16_features
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.rl.corrections import mismatch_stats
from tests.e2e.conftest import small_job

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not cpu_bf16_features(), reason="bf16 trainer: the placement refuses it here")]


def test_fp32_heads_on_a_bf16_job(tmp_path):
    cfg = small_job(tmp_path, "engine.tp=1", "placement.num_slots=1", "trainer.mixed_precision=true",
                    "trainer.fp32_lm_head=true", "engine.fp32_lm_head=true", "sync.verify=full")
    with Runtime(cfg) as rt:
        assert rt.engine_info[0]["logits_dtype"] == "float32"  # what vLLM's LogitsProcessor decided
        assert rt.trainer_info[0]["compute_dtype"] == "bfloat16" and rt.trainer_info[0]["logits_dtype"] == "float32"
        layouts = ray.get(rt.engines[0].param_layouts.remote())
        assert {dtype for layout in layouts for _, _, dtype in layout["params"]} == {"torch.bfloat16"}
        # before the first step, which ends with the trainer offloaded (small_job: trainer.offload=true)
        log_w, seq_log_w, _ = _measure(rt, [[5, 6, 7, 16], [9, 8, 16]], 4, 24, 1.0, 1.0, cfg.engine.seed)
        stats = mismatch_stats(log_w, seq_log_w, band=BAND)["token"]
        assert stats["count"] == log_w.numel() > 0
        assert stats["fraction_outside_band"] == 0.0, stats
        # the consistency bench's parts (bench/consistency.py): the engine's prefill of each whole sequence
        # (prompt_logprobs) beside its decode and the trainer's recompute, token for token
        seqs = _sample(rt, [[5, 6, 7, 16], [9, 8, 16]], 2, 16, cfg.engine.seed)
        logprobs = {"decode": [s.logprobs for s in seqs], "prefill": _prefill(rt, seqs), "trainer": score(rt, seqs)}
        tokens = sum(len(s.response_ids) for s in seqs)
        for a, b in (("decode", "prefill"), ("prefill", "trainer")):
            pair = compare(logprobs[a], logprobs[b])
            assert pair["tokens"] == tokens and pair["max_abs"] < math.log(BAND), (a, b, pair)
        Controller(cfg, rt).step(0)  # sync.verify=full raises on any mismatch: the head synced as bf16
