"""LoRA: the trainer's adapter layers, the reshard rules that write an adapter into vLLM's LoRA buffers under TP,
the preflight's count of what a LoRA job trains, and the bad inputs refused in one line before anything starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colocate.config import ConfigError, load_config
from colocate.job.checks import check_lora
from colocate.job.preflight import model_dims, num_adapter_params, trainer_state_bytes
from colocate.sync.reshard import plan_pieces
from colocate.sync.tp_layout import TPLayout, compare_engine_state, engine_tensor
from colocate.trainer.lora import LoRALinear, adapters_disabled, add_lora, lora_targets
from tests.unit.test_reshard import HD, NKV, NQ, H, INTER, apply_pieces


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.ModuleDict({p: nn.Linear(H, NQ * HD if p == "q_proj" else NKV * HD, bias=True)
                                        for p in ("q_proj", "k_proj", "v_proj")})
        self.self_attn["o_proj"] = nn.Linear(NQ * HD, H, bias=False)
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(H, INTER, bias=False),
                                  "up_proj": nn.Linear(H, INTER, bias=False),
                                  "down_proj": nn.Linear(INTER, H, bias=False), "gate": nn.Linear(H, 4, bias=False)})

    def forward(self, x):
        a = self.self_attn
        x = x + a["o_proj"](a["q_proj"](x))
        m = self.mlp
        return x + m["down_proj"](m["gate_proj"](x) * m["up_proj"](x))


def test_an_adapted_layer_starts_as_its_base_keeps_its_names_and_trains_alone():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(3, H)
    before = model(x)
    base_names = {n for n, _ in model.named_parameters()}
    targets = lora_targets(model, ["all-linear"])
    # the router (mlp.gate) is a linear layer too, but not a projection the engine adapts
    assert sorted(targets["all-linear"]) == sorted(f"{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    num_trained = add_lora(model, targets["all-linear"], rank=8, alpha=16, seed=0)
    assert torch.equal(model(x), before)  # B = 0: the policy at step 0 is the base model
    names = {n for n, _ in model.named_parameters()}
    assert base_names <= names  # the base keeps its names: its checkpoint loads, the engine's base is untouched
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == names - base_names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in trained)
    assert num_trained == sum(p.numel() for n, p in model.named_parameters() if n in trained)
    q = model[0].self_attn["q_proj"]
    assert isinstance(q, LoRALinear) and isinstance(q, nn.Linear)
    assert q.lora_A.weight.shape == (8, H) and q.lora_B.weight.shape == (NQ * HD, 8) and q.scaling == 2.0

    # y = base + alpha / rank * B A x, PEFT's; disabled, the adapter computes nothing (a LoRA job's reference)
    with torch.no_grad():
        q.lora_B.weight.normal_()
    expected = nn.functional.linear(x, q.weight, q.bias) + 2.0 * x @ q.lora_A.weight.T @ q.lora_B.weight.T
    assert torch.allclose(q(x), expected, atol=1e-6)
    with adapters_disabled(model):
        assert torch.equal(model(x), before)
    assert not torch.equal(model(x), before)


def test_every_rank_builds_the_same_adapters():
    models = []
    for _ in range(2):
        model = Block()
        add_lora(model, [n for n, m in model.named_modules() if n.endswith("_proj")], rank=8, alpha=8, seed=0)
        models.append(dict(model.named_parameters()))
    for name, value in models[0].items():
        if ".lora_" in name:
            assert torch.equal(value, models[1][name]), name


def adapter_state(rank: int, engine_rank: int, num_layers: int = 2) -> dict[str, torch.Tensor]:
    """A trainer's adapter as the sync sends it: A [rank, in], B [out, engine_rank] (scaled, zero-padded past
    the adapter's rank: trainer/lora.py ScaledB)."""
    g = torch.Generator().manual_seed(0)
    dims = {"self_attn.q_proj": (H, NQ * HD), "self_attn.k_proj": (H, NKV * HD), "self_attn.v_proj": (H, NKV * HD),
            "self_attn.o_proj": (NQ * HD, H), "mlp.gate_proj": (H, INTER), "mlp.up_proj": (H, INTER),
            "mlp.down_proj": (INTER, H)}
    state = {}
    for i in range(num_layers):
        for module, (num_in, num_out) in dims.items():
            name = f"model.layers.{i}.{module}"
            state[f"{name}.lora_A.weight"] = torch.randn(rank, num_in, generator=g)
            b = torch.zeros(num_out, engine_rank)
            b[:, :rank] = torch.randn(num_out, rank, generator=g)
            state[f"{name}.lora_B.weight"] = b
    return state


def vllm_adapter_shapes(state: dict, layout: TPLayout, engine_rank: int) -> list[tuple[str, tuple[int, int]]]:
    """What a vLLM worker's LoRA buffers hold per sub-layer (vllm/lora/layers/base_linear.py create_lora_weights):
    A [max_lora_rank, in (row-parallel: this rank's columns)], B [out (column-parallel: this rank's rows), rank]."""
    tp = layout.tp_size
    kv_rows = max(1, NKV // tp) * HD
    out = []
    for name, t in state.items():
        projection = name.split(".")[-3]
        if name.endswith("lora_A.weight"):
            cols = t.shape[1] // tp if projection in ("o_proj", "down_proj") else t.shape[1]
            out.append((name, (engine_rank, cols)))
        else:
            rows = {"q_proj": NQ * HD // tp, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": INTER // tp,
                    "up_proj": INTER // tp}.get(projection, t.shape[0])
            out.append((name, (rows, engine_rank)))
    return out


@pytest.mark.parametrize("tp_size", [1, 2, 4], ids=lambda t: f"tp{t}")  # tp4: each KV head on two workers
@pytest.mark.parametrize("rank, engine_rank", [(8, 8), (8, 16), (4, 8)],
                         ids=["same_rank", "engine_rank_larger", "rank_4_in_vllms_8"])
def test_adapter_pieces_fill_each_workers_lora_buffers(tp_size, rank, engine_rank):
    state = adapter_state(rank, engine_rank)
    for tp_rank in range(tp_size):
        layout = TPLayout(tp_rank, tp_size, NQ, NKV, HD, 100)
        shapes = vllm_adapter_shapes(state, layout, engine_rank)
        pieces = plan_pieces(shapes, {n: tuple(t.shape) for n, t in state.items()}, layout)
        assert pieces is not None and len(pieces) == len(shapes)  # one copy per tensor
        built = apply_pieces(pieces, shapes, state)
        for name, shape in shapes:
            expected = engine_tensor(name, state, layout)
            assert torch.equal(built[name][: expected.shape[0]], expected), (tp_rank, name)
            assert torch.isnan(built[name][expected.shape[0]:]).all()  # A's rows past the adapter's rank
        # the oracle's view of a synced worker: padding rows are vLLM's zeros, compared only up to the rank
        engine_state = {n: torch.nan_to_num(t, nan=0.0) for n, t in built.items()}
        assert compare_engine_state(engine_state, state, layout) == []
        first = shapes[0][0]  # an A
        synced = engine_state[first].clone()
        engine_state[first][0, 0] += 1
        assert compare_engine_state(engine_state, state, layout) == [first]
        if rank < engine_rank:  # a stale page past the adapter's rank is found: vLLM computes with the whole buffer
            engine_state[first] = synced
            engine_state[first][rank, 0] = float("nan")
            assert compare_engine_state(engine_state, state, layout) == [first]


def test_a_sub_layer_the_adapter_leaves_out_must_stay_zero():
    state = {k: v for k, v in adapter_state(8, 8, num_layers=1).items() if "k_proj" not in k}
    layout = TPLayout(0, 1, NQ, NKV, HD, 100)
    engine = {"model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(8, H)}
    assert compare_engine_state(engine, state, layout) == []
    engine["model.layers.0.self_attn.k_proj.lora_A.weight"][1, 2] = 1.0
    assert compare_engine_state(engine, state, layout) == ["model.layers.0.self_attn.k_proj.lora_A.weight"]


@pytest.mark.parametrize("preset, targets, fraction", [
    ("tiny", "all-linear", (0.09, 0.10)),
    ("bench", "all-linear", (0.010, 0.011)),  # the bound on sync bytes: 2% at rank 8
    ("tiny-moe", "all-linear", (0.02, 0.03)),  # attention alone: the experts are fused tensors
    ("tiny", "q_proj,v_proj", (0.017, 0.018)),
])
def test_the_preflight_counts_what_a_lora_job_trains(preset, targets, fraction):
    cfg = load_config(None, [f"model.preset={preset}", "trainer.lora.rank=8", f"trainer.lora.target_modules={targets}"])
    dims = model_dims(cfg)
    num_trained = num_adapter_params(cfg, dims)
    assert fraction[0] < num_trained / dims.num_params < fraction[1]
    kept, training = trainer_state_bytes(cfg, dims)
    # fp32 base and adapter; grads and AdamW's two moments for the adapter alone
    assert (kept, training) == (4 * (dims.num_params + num_trained) + 8 * num_trained,
                                4 * (dims.num_params + num_trained) + 12 * num_trained)
    full = load_config(None, [f"model.preset={preset}"])
    assert trainer_state_bytes(full, dims) == (12 * dims.num_params, 16 * dims.num_params)


def test_the_preflight_count_is_the_trainers():
    """num_adapter_params against the adapters the trainer really builds on the tiny presets' models."""
    from transformers import AutoModelForCausalLM

    from colocate.models.sources import ensure_model

    for preset in ("tiny", "tiny-moe"):
        cfg = load_config(None, [f"model.preset={preset}", "trainer.lora.rank=8", "model.cache_dir=.cache/models"])
        model = AutoModelForCausalLM.from_pretrained(ensure_model(cfg.model))
        num_trained = add_lora(model, lora_targets(model, ["all-linear"])["all-linear"], rank=8, alpha=16, seed=0)
        assert num_trained == num_adapter_params(cfg, model_dims(cfg)), preset


@pytest.mark.parametrize("overrides, line", [
    (["trainer.lora.rank=600"], "trainer.lora.rank=600 is invalid: valid: 0 (no LoRA) or 1 to 512 (vLLM's largest "
                                "max_lora_rank)"),
    (["trainer.lora.rank=12", "engine.max_lora_rank=8"],
     "trainer.lora.rank=12 is invalid: is above engine.max_lora_rank=8, the largest adapter rank the engine holds; "
     "valid: 1 to 8, or engine.max_lora_rank=0 (then 16: the smallest of vLLM's ranks that holds it)"),
    (["engine.max_lora_rank=24"], "engine.max_lora_rank=24 is invalid: valid: 0 (the smallest that holds the "
                                  "trainer's LoRA rank) or one of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    (["engine.max_lora_rank=8"], "engine.max_lora_rank=8 is invalid: applies to a LoRA job (trainer.lora.rank > 0); "
                                 "valid here: 0"),
    (["trainer.lora.rank=8", "trainer.lora.alpha=0"], "trainer.lora.alpha=0.0 is invalid: must be > 0"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=lm_head"],
     "trainer.lora.target_modules='lm_head' is invalid: 'lm_head' is not a projection the engine can adapt; valid: "
     "all-linear, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
])
def test_bad_lora_settings_are_one_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value) == line


def test_target_modules_that_match_nothing_are_refused_before_anything_starts():
    cfg = load_config(None, ["model.preset=tiny-moe", "trainer.lora.rank=8",
                             "trainer.lora.target_modules=q_proj,up_proj"])
    with pytest.raises(ConfigError) as e:
        check_lora(cfg, model_dims(cfg))
    assert str(e.value) == ("trainer.lora.target_modules='q_proj,up_proj' is invalid: up_proj matches no linear layer "
                            "of model.preset=tiny-moe; valid: all-linear, q_proj, k_proj, v_proj, o_proj")
    dense = load_config(None, ["trainer.lora.rank=8", "trainer.lora.target_modules=q_proj,up_proj"])
    check_lora(dense, model_dims(dense))


@pytest.mark.parametrize("rank, engine_rank, resolved", [
    (1, 0, 1), (4, 0, 8), (8, 0, 8), (9, 0, 16), (12, 0, 16), (100, 0, 128), (321, 0, 512), (512, 0, 512),
    (4, 16, 16), (12, 16, 16)])
def test_any_rank_up_to_the_engines_is_taken_and_held_in_vllms_next_rank(rank, engine_rank, resolved):
    """vLLM takes nine max_lora_ranks and serves a smaller adapter in larger buffers: every trainer rank from 1 to
    512 runs, in the smallest of them that holds it unless engine.max_lora_rank says more (what the engine
    starts with and the trainer pads B to: job/resolve.py, trainer/actor.py)."""
    from colocate.config.schema import engine_lora_rank
    from colocate.job.resolve import resolve_job

    cfg = load_config(None, [f"trainer.lora.rank={rank}", f"engine.max_lora_rank={engine_rank}"])
    assert engine_lora_rank(rank, engine_rank) == resolved
    assert resolve_job(cfg, device="cpu").config.engine.max_lora_rank == resolved
    assert resolve_job(load_config(None, []), device="cpu").config.engine.max_lora_rank == 0  # no LoRA
