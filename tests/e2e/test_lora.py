"""A LoRA job through `colocate launch` (trainer.lora.rank=4 on every projection of the tiny model, TP=2, held in
vLLM's rank-8 buffers): each sync sends the adapter alone, in place, into vLLM's LoRA buffers, and
`sync.verify=full` finds every engine tensor (base and adapter, A's rows past rank 4 zero) equal to the trainer's
after every step. The engine computes with that adapter: the mismatch between its logprobs and the trainer's stays
at the floor while the adapter moves the policy (an engine generating without it read 0.27-0.38 on this job by
step 1, measured at rank 8). The base never moves.

And a LoRA engine of a MoE model under expert parallelism on its own (tests/e2e/lora_engine.py, which its GPU twin
runs too): only the trainer's projections carry adapter buffers, and a level-2 wake leaves none of what the
buffers held before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colocate.config import ModelConfig
from colocate.models.sources import ensure_model
from tests.e2e.conftest import ROOT, checkpoint_tensors, launch

pytestmark = pytest.mark.e2e


def test_a_lora_job_syncs_only_the_adapter_and_the_engine_computes_with_it(tmp_path):
    result = launch(tmp_path, "trainer.lora.rank=4", "trainer.lr=0.05", "algo.num_steps=3", "sync.verify=full",
                    "logging.progress=false", "engine.dtype=float32", "eval.at_end=true", "eval.max_prompts=6",
                    "eval.max_tokens=6")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    startup = records[0]
    trainer = startup["trainers"][0]
    assert trainer["num_trained_params"] == 19_456  # rank 4 x (in + out) of 7 projections x 2 layers
    # the base is the model's, bit for bit; the adapter moved
    base = ensure_model(ModelConfig(cache_dir=str(ROOT / ".cache" / "models")))
    start = load_file(f"{base}/model.safetensors")
    [final] = (tmp_path / "out" / "checkpoints").iterdir()
    state = {k.removeprefix("model."): v for k, v in checkpoint_tensors(final).items() if k.startswith("model.")}
    for name, before in start.items():
        assert torch.equal(state[name], before), name
    adapters = {k: v for k, v in state.items() if ".lora_B." in k}
    assert len(adapters) == 14 and all(v.abs().sum() > 0 for v in adapters.values())
    assert {v.shape[1] for v in adapters.values()} == {4}
    # what the engine receives: A [4, in], B scaled and padded to the engine's rank 8 (its extra columns zero)
    sent = sum(v.numel() for k, v in state.items() if ".lora_A." in k) + 2 * sum(v.numel() for v in adapters.values())
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        # the adapter alone, as each TP worker holds it: column-parallel A whole on both workers, the rest split
        assert r["sync_mode"] == "sliced" and r["sync_method"] == "in_place" and r["sync_round_trips"] == 1
        assert 4 * sent <= r["sync_bytes"] < 2 * 4 * sent  # fp32, 7% of the tiny model's 1.8 MB
        assert r["mismatch"] < 0.01, r["mismatch"]

    # the export, as the adapter and merged, answers as the job's engine did after its last step
    job_answers = [json.loads(line) for line in (tmp_path / "out" / "eval" / "after_3_steps.jsonl").read_text()
                   .splitlines()]
    prompts, engine_tokens = json.dumps([a["prompt"] for a in job_answers]), [a["token_ids"][0] for a in job_answers]
    assert len(job_answers) == 6
    cli = Path(sys.executable).parent / "colocate"
    for kind, flags in (("adapter", []), ("merged", ["--merged"])):
        exported = tmp_path / kind
        done = subprocess.run([str(cli), "export", str(final), str(exported), "--dtype", "float32", *flags], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        load = [str(exported), prompts, "6", "--only", "transformers"] if kind == "merged" else \
            [base, prompts, "6", "--adapter", str(exported)]
        out = subprocess.run([sys.executable, str(Path(__file__).parent / "load_export.py"), *load], cwd=ROOT,
                             capture_output=True, text=True, timeout=600, env={**os.environ})
        assert out.returncode == 0, out.stderr[-3000:]
        loaded = json.loads(out.stdout.strip().splitlines()[-1])
        assert all(tokens == engine_tokens for tokens in loaded.values()), (kind, loaded, engine_tokens)
        assert len(loaded) == (1 if kind == "merged" else 2)


def test_a_moe_engine_under_expert_parallelism_adapts_the_trainers_projections_and_wakes_with_no_stale_page(tmp_path):
    """tiny-moe, TP=2 with expert parallelism, a rank-4 adapter in rank-8 buffers: vLLM wraps what the trainer
    adapts (the attention) and no expert, so the layout report the sync plans by opens; and after a level-2 sleep
    every LoRA buffer reads zero though each held NaN before it (engine/lora.py reset_adapter)."""
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "lora_engine.py"), "cpu", "tiny-moe", "--tp", "2",
                          "--expert-parallel", "--rank", "4", "--cache-dir", str(ROOT / ".cache" / "models")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["max_lora_rank"] == 8  # vLLM's smallest rank that holds 4
    assert r["experts"] == [{"tp_rank": 0, "tp_size": 1, "expert_ids": [0, 1, 2, 3]},
                            {"tp_rank": 0, "tp_size": 1, "expert_ids": [4, 5, 6, 7]}]
    assert len(r["trainer_adapter"]) == 16  # q, k, v, o x A, B x 2 layers: the experts are fused tensors
    for worker in r["adapter"]:  # each worker holds exactly the trainer's adapter tensors, in rank-8 buffers
        assert sorted(name for name, _ in worker) == r["trainer_adapter"]
        for name, shape in worker:
            assert (shape[0] if ".lora_A." in name else shape[1]) == 8, (name, shape)
    assert r["num_poisoned"] == [16, 16]
    assert not r["finite_logprobs"]["poisoned"]  # the engine computes with every row of its buffers
    assert r["cached_before"] == [True, True] and r["cached_after"] == [False, False]
    assert r["nonzero_after_wake"] == [[], []]
    assert r["tokens"]["after"] == r["tokens"]["base"] and r["finite_logprobs"]["after"]
    # vLLM's TP all-reduce segments, one per worker, which vLLM never unlinks: the engine's shutdown did
    assert sum("cpushm" in name for name in r["worker_entries"]) == 2 and r["entries_left"] == []
