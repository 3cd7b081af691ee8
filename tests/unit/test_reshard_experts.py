"""The reshard plan for a MoE model's fused experts against the independent layout oracle: under TP (each expert's
intermediate dimension split), under expert parallelism (a block of experts per worker, whole), and under an
expert map that is not a block; consecutive experts merge into one piece, a layer's experts share its bucket, and
what the rule does not describe (padded experts, per-expert HF tensors) gets no plan."""

from __future__ import annotations

import pytest
import torch

from colocate.sync.buckets import TensorSpec
from colocate.sync.reshard import build_sync_plan, plan_pieces
from colocate.sync.tp_layout import ExpertLayout, TPLayout, engine_tensor
from tests.unit.test_reshard import HD, NKV, NQ, H, apply_pieces

E, I, VOCAB = 8, 32, 48  # experts, moe intermediate size  # noqa: E741 (I: the intermediate size, as in vLLM's MoE)
TENSORS = ("w13_weight", "w2_weight")


def moe_state(num_layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (NQ * HD, H), p + "self_attn.k_proj.weight": (NKV * HD, H),
            p + "self_attn.v_proj.weight": (NKV * HD, H), p + "self_attn.o_proj.weight": (H, NQ * HD),
            p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate.weight": (E, H),  # the router
            p + "mlp.experts.gate_up_proj": (E, 2 * I, H), p + "mlp.experts.down_proj": (E, H, I),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
        })
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def moe_engine_shapes(hf: dict, layout: TPLayout) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM 0.32's Qwen3-MoE parameter names for one worker (as the CPU build reports them), shapes from the oracle."""
    names = ["model.embed_tokens.weight"]
    for i in range(2):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight", p + "self_attn.q_norm.weight",
                  p + "self_attn.k_norm.weight", p + "mlp.gate.weight",
                  p + "mlp.experts.routed_experts.w13_weight", p + "mlp.experts.routed_experts.w2_weight",
                  p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names += ["model.norm.weight", "lm_head.weight"]
    padded = 64 // layout.tp_size
    return [(n, (padded, H) if n.endswith(("embed_tokens.weight", "lm_head.weight"))
             else tuple(engine_tensor(n, hf, layout).shape)) for n in names]


def worker_layouts(tp_size: int, expert_parallel: bool, expert_ids=None) -> list[TPLayout]:
    layouts = []
    for rank in range(tp_size):
        if expert_parallel:
            ids = expert_ids[rank] if expert_ids else range(rank * E // tp_size, (rank + 1) * E // tp_size)
            experts = ExpertLayout(0, 1, tuple(ids))
        else:
            experts = ExpertLayout(rank, tp_size, tuple(range(E)))
        layouts.append(TPLayout(rank, tp_size, NQ, NKV, HD, VOCAB, experts))
    return layouts


@pytest.mark.parametrize("tp_size, expert_parallel, expert_ids, pieces_per_tensor", [
    pytest.param(1, False, None, {"w13_weight": 1, "w2_weight": 1}, id="tp1"),
    # TP: per expert a gate block and an up block (2 x 8); down's column block of all experts is one piece
    pytest.param(2, False, None, {"w13_weight": 16, "w2_weight": 1}, id="tp2"),
    pytest.param(2, True, None, {"w13_weight": 1, "w2_weight": 1}, id="ep2"),
    pytest.param(4, True, None, {"w13_weight": 1, "w2_weight": 1}, id="ep4"),
    pytest.param(2, True, [(0, 2, 4, 6), (1, 3, 5, 7)], {"w13_weight": 4, "w2_weight": 4}, id="ep2_round_robin"),
])
def test_expert_pieces_reproduce_each_workers_tensors(tp_size, expert_parallel, expert_ids, pieces_per_tensor):
    hf = moe_state()
    hf_shapes = {n: tuple(t.shape) for n, t in hf.items()}
    for layout in worker_layouts(tp_size, expert_parallel, expert_ids):
        shapes = moe_engine_shapes(hf, layout)
        pieces = plan_pieces(shapes, hf_shapes, layout)
        assert pieces is not None
        built = apply_pieces(pieces, shapes, hf)
        for name, _ in shapes:
            expected = engine_tensor(name, hf, layout)
            assert torch.equal(built[name][: expected.shape[0]], expected), (layout.tp_rank, name)
        for leaf in TENSORS:
            name = f"model.layers.0.mlp.experts.routed_experts.{leaf}"
            assert sum(p.engine_name == name for p in pieces) == pieces_per_tensor[leaf], leaf


def test_the_oracle_gives_each_worker_its_experts_and_block():
    """The oracle itself, from first principles: expert-parallel worker 1 of 2 holds experts 4..7 whole; TP
    worker 1 of 2 holds every expert's second half of gate, of up, and of down's columns."""
    hf = moe_state()
    gate_up, down = hf["model.layers.1.mlp.experts.gate_up_proj"], hf["model.layers.1.mlp.experts.down_proj"]
    prefix = "model.layers.1.mlp.experts.routed_experts."
    ep = worker_layouts(2, True)[1]
    assert torch.equal(engine_tensor(prefix + "w13_weight", hf, ep), gate_up[4:])
    assert torch.equal(engine_tensor(prefix + "w2_weight", hf, ep), down[4:])
    tp = worker_layouts(2, False)[1]
    w13 = engine_tensor(prefix + "w13_weight", hf, tp)
    assert w13.shape == (E, I, H)
    assert torch.equal(w13[3, : I // 2], gate_up[3, I // 2: I])
    assert torch.equal(w13[3, I // 2:], gate_up[3, I + I // 2:])
    assert torch.equal(engine_tensor(prefix + "w2_weight", hf, tp), down[:, :, I // 2:])


def test_what_the_rule_does_not_describe_gets_no_plan():
    hf = moe_state()
    hf_shapes = {n: tuple(t.shape) for n, t in hf.items()}
    layout = worker_layouts(2, False)[0]
    shapes = moe_engine_shapes(hf, layout)
    # padded experts (vLLM pads the intermediate dimension for some kernels): rows the trainer has no bytes for
    padded = [(n, (E, 2 * I, H) if n.endswith("layers.0.mlp.experts.routed_experts.w13_weight") else s)
              for n, s in shapes]
    assert plan_pieces(padded, hf_shapes, layout) is None
    # per-expert HF tensors (an older checkpoint layout): the full-tensor path loads those
    per_expert = {n: s for n, s in hf_shapes.items() if "experts." not in n}
    for e in range(E):
        per_expert[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = (I, H)
    assert plan_pieces(shapes, per_expert, layout) is None
    # a worker that did not report its experts
    assert plan_pieces(shapes, hf_shapes, TPLayout(0, 2, NQ, NKV, HD, VOCAB)) is None


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_sync_plan_uses_the_workers_reported_experts_and_keeps_a_layer_together(expert_parallel):
    hf = moe_state()
    specs = [TensorSpec(n, tuple(t.shape), torch.bfloat16) for n, t in hf.items()]
    layouts = []
    for layout in worker_layouts(2, expert_parallel):
        params = [(n, s, "torch.bfloat16") for n, s in moe_engine_shapes(hf, layout)]
        e = layout.experts
        layouts.append({"tp_rank": layout.tp_rank, "tp_size": 2, "params": params,
                        "experts": {"tp_rank": e.tp_rank, "tp_size": e.tp_size, "expert_ids": list(e.expert_ids)}})
    plan = build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB), bucket_bytes=0,
                           num_slots=2)
    assert plan.mode == "sliced"
    assert [b.group for b in plan.buckets] == ["pre", "layer.0", "layer.1", "post"]  # one bucket per layer
    for rank in range(2):
        names = {r.engine_name for r in plan.buckets[1].regions[rank]}
        assert {"model.layers.0.mlp.experts.routed_experts.w13_weight",
                "model.layers.0.mlp.experts.routed_experts.w2_weight", "model.layers.0.mlp.gate.weight"} <= names
    # without the workers' reports the experts have no rule: the full-tensor plan
    for layout in layouts:
        del layout["experts"]
    assert build_sync_plan(specs, layouts, lambda r, s: TPLayout(r, s, NQ, NKV, HD, VOCAB), bucket_bytes=0,
                           num_slots=2).mode == "full"
