"""What a LoRA job's engines are started with (the arguments vLLM receives, before any engine starts): the policy's
engine wraps exactly the trainer's projections, a MoE model's included; the reward model's engine carries no
adapter and none of the policy's expert layout. The engines themselves: tests/e2e/test_lora.py."""

from __future__ import annotations

import pytest

from colocate.config import load_config
from colocate.engine.actor import EngineActor
from colocate.engine.reward_engine import RewardEngineActor, reward_engine_config
from colocate.job.setup import check_job
from colocate.job.resolve import resolve_job
from tests.unit.test_lora import adapter_state


def resolved(*overrides: str):
    return resolve_job(load_config(None, list(overrides)), device="cpu").config


def policy_kwargs(cfg, shapes: dict) -> dict:
    engine = EngineActor(cfg.engine, "/models/policy", device="cpu", sleep_backend="portable", eos_token_id=None)
    engine._adapter_shapes = shapes  # what start() records before it builds the engine
    return engine._llm_kwargs()


@pytest.mark.parametrize("targets, wrapped", [
    ("all-linear", ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("q_proj,v_proj", ["q_proj", "v_proj"]),  # vLLM wraps qkv_proj for them (k's part stays zero), nothing else
])
def test_the_policy_engine_wraps_the_trainers_projections_alone(targets, wrapped):
    cfg = resolved("trainer.lora.rank=4", f"trainer.lora.target_modules={targets}")
    shapes = {n: tuple(t.shape) for n, t in adapter_state(4, 8).items() if n.rsplit(".", 3)[1] in wrapped}
    kwargs = policy_kwargs(cfg, shapes)
    assert {k: kwargs[k] for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
                                   "lora_target_modules")} == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1, "lora_target_modules": wrapped}


def test_a_moe_lora_job_under_expert_parallelism_passes_validate_and_leaves_the_experts_unwrapped():
    """MoE + LoRA: the trainer adapts the attention (the experts are fused tensors, not linear layers); the engine
    is told to wrap exactly that, so its experts carry no LoRA layer (whose layout no trainer tensor maps to)."""
    overrides = ("model.preset=tiny-moe", "engine.expert_parallel=true", "trainer.lora.rank=4")
    check_job(load_config(None, list(overrides)))  # what `colocate validate` and launch run: no refusal
    cfg = resolved(*overrides)
    attention = {n: s for n, s in ((n, tuple(t.shape)) for n, t in adapter_state(4, 8).items()) if "self_attn" in n}
    kwargs = policy_kwargs(cfg, attention)
    assert kwargs["enable_expert_parallel"] and kwargs["lora_target_modules"] == ["k_proj", "o_proj", "q_proj",
                                                                                  "v_proj"]


def test_the_reward_models_engine_carries_no_adapter_and_none_of_the_policys_expert_layout():
    """The policy: a MoE model with a rank-4 adapter over experts split by expert parallelism at TP=2. The reward
    model is another model on its own TP (reward_model.tp): no LoRA buffers, no expert parallelism."""
    cfg = resolved("model.preset=tiny-moe", "engine.expert_parallel=true", "trainer.lora.rank=4",
                   "rollout.rewards=model:tiny-rm")
    assert cfg.engine.max_lora_rank == 8 and cfg.engine.expert_parallel and cfg.engine.tp == 2
    rm_cfg = reward_engine_config(cfg.engine, cfg.reward_model)
    assert rm_cfg.max_lora_rank == 0 and not rm_cfg.expert_parallel and rm_cfg.tp == cfg.reward_model.tp == 1
    actor = RewardEngineActor(rm_cfg, "/models/rm", kind="model", rm_cfg=cfg.reward_model, device="cpu",
                              sleep_backend="portable")
    kwargs = actor._llm_kwargs()
    assert "enable_lora" not in kwargs and "lora_target_modules" not in kwargs
    assert kwargs["enable_expert_parallel"] is False and kwargs["tensor_parallel_size"] == 1
    # the policy's own engine has both, from the same config
    shapes = {n: tuple(t.shape) for n, t in adapter_state(4, 8).items() if "self_attn" in n}
    policy = policy_kwargs(cfg, shapes)
    assert policy["enable_lora"] and policy["enable_expert_parallel"]
