"""Checkpoints, exact resume and HF export through `colocate launch` / `colocate export`, as a user runs them.

One uninterrupted 4-step run against a run resumed from its checkpoint after step 1 (resume=PATH, into another
output directory): the trainer shards (weights and AdamW moments), the data place, the answers carried in flight
(partial rollout: each continues from its segment seed, which the saved answer decides), the learning rate of a
cosine schedule resumed mid-warmup, the groups dynamic sampling kept and every step's metrics are equal. The
resumed run's final checkpoint exported as a Hugging Face model is loaded by vLLM (the CPU build) and by
transformers, and both answer the evaluation prompts greedily with exactly the tokens the job's own engine gave
(engine.dtype=float32: bit-equal weights everywhere).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import ROOT, checkpoint_tensors, launch

pytestmark = pytest.mark.e2e

JOB = ["algo.num_steps=4", "engine.dtype=float32", "checkpoint.keep_last=0", "logging.progress=false",
       "rollout.max_tokens=6", "eval.max_prompts=6", "eval.max_tokens=6", "engine.tp=1",
       # answers carried across steps, and so across the checkpoint: 3 tokens a pass, 24 groups in flight for 16
       # trained, 64 decoding at once (the third wave's answers wait with their first 3 tokens)
       "rollout.partial_tokens=3", "rollout.oversample=1.5", "engine.max_num_seqs=64",
       # a cosine schedule resumed mid-warmup (steps 0-2 warm up; the resumed run starts at step 2), and DAPO's
       # dynamic sampling, whose refills draw prompts from the data stream within a step
       "trainer.lr_schedule=cosine", "trainer.lr_warmup_steps=3", "trainer.lr_min_ratio=0.1",
       "algo.dynamic_sampling=true"]


def _steps(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "event" not in r}  # a resumed step's last record counts


def test_resume_is_exact_and_the_export_loads(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = launch(whole, *JOB, "checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    a = whole / "out" / "checkpoints"
    assert sorted(p.name for p in a.iterdir()) == ["step_00000001", "step_00000003"]
    # as if the run had stopped after step 1: a new run from that checkpoint (one launch fewer than running a
    # 2-step job first; its end checkpoint is written as the periodic one is, and every other e2e job writes one)
    result = launch(resumed, *JOB, "checkpoint.every_steps=2", f"resume={a / 'step_00000001'}", "eval.at_end=true")
    assert result.returncode == 0, result.stderr[-3000:]

    b = resumed / "out" / "checkpoints"
    assert sorted(p.name for p in b.iterdir()) == ["step_00000003"]
    events = [json.loads(line) for line in (resumed / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume" and e["step"] == 1 for e in events)

    # the same training: weights and optimizer state bit-equal, the data at the same place, the same metrics
    whole_state, resumed_state = checkpoint_tensors(a / "step_00000003"), checkpoint_tensors(b / "step_00000003")
    assert whole_state.keys() == resumed_state.keys() and any(k.startswith("optimizer.") for k in whole_state)
    for key, value in whole_state.items():
        assert torch.equal(value, resumed_state[key]), key
    controller = [json.loads((d / "step_00000003" / "controller.json").read_text()) for d in (a, b)]
    assert controller[0] == controller[1]
    saved = json.loads((a / "step_00000001" / "controller.json").read_text())  # where the resumed run started
    assert any(ans["token_ids"] and not ans["finish_reason"] for g in saved["rollouts"]["pool"]["groups"]
               for ans in g["answers"]), "no unfinished answer was carried across the checkpoint"
    whole_steps, resumed_steps = _steps(whole / "out"), _steps(resumed / "out")
    for step in (2, 3):
        for key in ("reward_mean", "response_len_mean", "loss", "mismatch", "lr"):
            assert whole_steps[step][key] == resumed_steps[step][key], (step, key)
        # the rollout's counts, dynamic sampling's among them (its seconds are the machine's)
        rollouts = [{k: v for k, v in run[step]["rollout"].items() if k != "seconds"}
                    for run in (whole_steps, resumed_steps)]
        assert rollouts[0] == rollouts[1] and "dynamic_sampling" in rollouts[0], step
    # warmup (s + 1) / 4 x lr for steps 0-2, then the cosine's start; the resumed run's step 2 is mid-warmup
    assert [whole_steps[s]["lr"] for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])

    # the export, loaded by vLLM and transformers, answers as the job's engine did after its last step
    exported = tmp_path / "hf"
    cli = Path(sys.executable).parent / "colocate"
    result = subprocess.run([str(cli), "export", str(b), str(exported), "--dtype", "float32"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    job_answers = [json.loads(line) for line in (resumed / "out" / "eval" / "after_4_steps.jsonl").read_text()
                   .splitlines()]
    assert len(job_answers) == 6
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "load_export.py"), str(exported),
                          json.dumps([a["prompt"] for a in job_answers]), "6"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    engine_tokens = [a["token_ids"][0] for a in job_answers]
    assert loaded["vllm"] == engine_tokens
    assert loaded["transformers"] == engine_tokens


def test_a_checkpoint_of_another_model_is_refused_before_anything_starts(tmp_path):
    checkpoint = tmp_path / "ckpt" / "step_00000000"
    (checkpoint / "trainer").mkdir(parents=True)
    from colocate.checkpoint.layout import model_signature
    from colocate.config import ModelConfig
    from colocate.models.sources import ensure_model

    model = model_signature(ensure_model(ModelConfig(cache_dir=str(ROOT / ".cache" / "models"))))
    signature = {"model": {**model, "hidden_size": 12345}, "num_trainer_ranks": 2, "num_samples": 4}
    (checkpoint / "meta.json").write_text(json.dumps({"step": 0, "signature": signature}))
    result = launch(tmp_path, f"resume={checkpoint}", timeout_s=120)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("colocate: error: checkpoint.resume=") and "another model" in line \
        and f"hidden_size=12345 there, {model['hidden_size']} here" in line, line
    result = launch(tmp_path, f"resume={tmp_path / 'nowhere'}", timeout_s=120)
    assert result.returncode == 2 and "no such directory" in result.stderr.strip().splitlines()[-1]
