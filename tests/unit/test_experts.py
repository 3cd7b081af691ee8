"""MoE pieces that need no engine: the CPU experts colocate runs in vLLM (against Hugging Face's own MoE block, and
split by an expert map as expert parallelism splits them), the tiny-moe preset's dimensions as the preflight counts
them, and engine.expert_parallel refused, in one line, where it cannot apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from colocate.config.loading import load_config
from colocate.engine.cpu_moe import plain_fused_experts
from colocate.errors import ConfigError
from colocate.job.checks import check_sources
from colocate.job.preflight import ModelDims, model_dims
from colocate.models.sources import PRESETS


def _hf_moe_block(seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                            norm_topk_prob=True)
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block, config


def _routing(block, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice as Qwen3-MoE (and vLLM's renormalising top-k) makes it: softmax, top-k, renormalise."""
    probs = F.softmax(F.linear(x, block.gate.weight).float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def test_the_cpu_experts_compute_what_hugging_faces_block_does():
    block, config = _hf_moe_block()
    x = torch.randn(10, config.hidden_size)
    weights, ids = _routing(block, x, config.num_experts_per_tok)
    ours = plain_fused_experts(x, block.experts.gate_up_proj.data, block.experts.down_proj.data, weights, ids)
    with torch.no_grad():
        theirs = block(x[None])
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(ours, theirs.reshape(ours.shape), rtol=1e-5, atol=1e-5)


def test_expert_parallel_halves_sum_to_the_whole():
    """Each worker computes only the experts its expert map gives it (-1: another worker's); the EP all-reduce
    sums the workers' outputs, which must equal one worker holding all experts."""
    block, config = _hf_moe_block(1)
    x = torch.randn(7, config.hidden_size)
    weights, ids = _routing(block, x, config.num_experts_per_tok)
    w13, w2 = block.experts.gate_up_proj.data, block.experts.down_proj.data
    whole = plain_fused_experts(x, w13, w2, weights, ids)
    parts = []
    for local in ([0, 1, 2], [3, 4, 5]):
        expert_map = torch.full((6,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(3, dtype=torch.int32)
        parts.append(plain_fused_experts(x, w13[local], w2[local], weights, ids, expert_map=expert_map))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-6)
    # weights already applied to the input (vLLM's apply_router_weight_on_input, top-1): summed unweighted
    top1 = ids[:, :1]
    ones = torch.ones_like(weights[:, :1])
    scaled = plain_fused_experts(x, w13, w2, ones, top1)
    assert torch.equal(plain_fused_experts(x, w13, w2, ones * 3, top1, weights_applied=True), scaled)
    with pytest.raises(NotImplementedError, match="relu2"):
        plain_fused_experts(x, w13, w2, weights, ids, activation="relu2")


def test_tiny_moe_dimensions_count_its_experts():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    preset = PRESETS["tiny-moe"]
    cfg = load_config(None, ["model.preset=tiny-moe"])
    dims = model_dims(cfg)
    assert dims.num_experts == 8 and dims.intermediate_size == 2 * 64  # top-2 experts' width per token
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=preset.vocab_size, hidden_size=preset.hidden_size, num_hidden_layers=preset.num_layers,
            num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_key_value_heads,
            head_dim=preset.head_dim, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64))
    actual = sum(p.numel() for p in model.parameters())
    assert abs(dims.num_params - actual) / actual < 0.002  # q/k norms counted as Qwen2's biases: 0.1%
    # a transformers 5 config names the experts num_local_experts; Mixtral's too
    saved = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4,
             "num_local_experts": 4, "intermediate_size": 16, "num_experts_per_tok": 2}
    assert ModelDims.from_config_dict(saved).num_experts == 4


def test_expert_parallel_needs_a_moe_model(tmp_path):
    out = f"logging.output_dir={tmp_path / 'out'}"
    with pytest.raises(ConfigError) as refused:
        check_sources(load_config(None, [out, "engine.expert_parallel=true"]))
    assert str(refused.value) == (
        "engine.expert_parallel=True is invalid: model.preset=tiny is a dense model (no routed experts in its "
        "config); expert parallelism splits a MoE model's experts (e.g. model.preset=tiny-moe); valid: false")
    with pytest.raises(ConfigError, match=r"has 8 experts per layer, fewer than engine.tp=16 workers"):
        check_sources(load_config(None, [out, "model.preset=tiny-moe", "engine.expert_parallel=true",
                                         "engine.tp=16", "placement.num_slots=16"]))
    check_sources(load_config(None, [out, "model.preset=tiny-moe", "engine.expert_parallel=true"]))


def test_validate_shows_each_workers_experts_as_vllm_places_them(capsys):
    from colocate.cli import main
    from colocate.job.placement import expert_block

    assert main(["validate", "model.preset=tiny-moe", "engine.expert_parallel=true"]) == 0
    out = capsys.readouterr().out
    assert "#   slot 0: trainer rank 0 | engine 0 tp worker 0 (experts 0-3 of 8)" in out
    assert "#   slot 1: trainer rank 1 | engine 0 tp worker 1 (experts 4-7 of 8)" in out
    # the same blocks as vLLM's own linear map, uneven counts included (10 experts over 4 ranks: 3, 3, 2, 2)
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for num_experts, size in ((8, 2), (10, 4), (128, 8), (7, 3)):
        for rank in range(size):
            count, expert_map, _ = determine_expert_map(size, rank, num_experts)
            local = (expert_map >= 0).nonzero().flatten().tolist()
            assert expert_block(rank, size, num_experts) == (local[0], count) and len(local) == count
