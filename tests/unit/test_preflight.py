"""Memory preflight: predicted phase peaks from the config, the switch plan, and one clear line when a phase
cannot fit (CPU and CUDA, the latter for GPU nodes described by size, not read from a device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colocate.cli import main
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.job.preflight import (
    CUDA_CONTEXT_BYTES,
    CUDA_GRAPH_POOL_BYTES,
    ENGINE_ASLEEP_BYTES,
    GIB,
    NCCL_COMMUNICATOR_BYTES,
    NCCL_COMMUNICATOR_PEERS_BYTES,
    SwitchPlan,
    check_environment,
    check_fits,
    model_dims,
    plan_switch,
    predict_phases,
    predict_train_peaks,
    preflight,
)

QWEN_7B = str(Path(__file__).resolve().parents[2] / "configs" / "models" / "Qwen2.5-7B")
H100, H200 = int(79.6 * GIB), int(139.7 * GIB)


def phases(*overrides):
    cfg = load_config(None, list(overrides))
    return cfg, {p.name: p for p in predict_phases(cfg, model_dims(cfg), device="cpu")}


def cuda_phases(*overrides, plan: SwitchPlan, gpu_bytes: int = H100):
    cfg = load_config(None, [f"model.path={QWEN_7B}", *overrides])
    return cfg, {p.name: p for p in predict_phases(cfg, model_dims(cfg), device="cuda", plan=plan,
                                                   gpu_bytes=gpu_bytes)}


def test_default_job_fits_this_machine():
    cfg, by_name = phases()
    check_fits(list(by_name.values()), available_bytes=16 * GIB, cfg=cfg, device="cpu")
    assert set(by_name) == {"startup", "rollout", "train", "sync"}


def test_kv_cache_larger_than_memory_names_phase_shortfall_and_key():
    cfg, by_name = phases("engine.kv_cache_gib=64")
    with pytest.raises(ConfigError) as err:
        check_fits(list(by_name.values()), available_bytes=16 * GIB, cfg=cfg, device="cpu")
    message = str(err.value)
    assert "phase 'rollout'" in message and "short by" in message and "engine.kv_cache_gib (now 64.0)" in message
    assert "\n" not in message


def test_sleep_level_1_keeps_a_host_copy_during_training():
    _, level2 = phases("model.preset=bench", "engine.sleep_level=2")
    _, level1 = phases("model.preset=bench", "engine.sleep_level=1")
    extra = level1["train"].total - level2["train"].total
    assert 0.5e9 < extra < 0.7e9  # the bench preset's ~0.6 GB of bf16 weights


def test_bigger_model_predicts_more_everywhere():
    _, tiny = phases()
    _, bench = phases("model.preset=bench")
    assert all(bench[name].total > tiny[name].total for name in tiny)


def test_expandable_segments_trap_is_refused_on_cuda(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ConfigError, match="PYTORCH_CUDA_ALLOC_CONF"):
        check_environment("cuda")
    check_environment("cpu")  # irrelevant without CUDA


# ------------------------------------------------------------------------------------------------ CUDA phases


def test_qwen_config_gives_the_published_parameter_count():
    dims = model_dims(load_config(None, [f"model.path={QWEN_7B}"]))
    assert dims.num_params == 7_615_616_512  # Qwen2.5-7B's model card: 7.61B
    assert dims.largest_sync_group == 152064 * 3584 + 3584  # the post block: untied lm_head + final norm


def test_cuda_predicts_four_phases_with_their_parts():
    _, by_name = cuda_phases("placement.num_slots=8", "engine.tp=2", plan=SwitchPlan(2, True, ""))
    assert list(by_name) == ["startup", "rollout", "train", "sync"]
    # every process's context, and an NCCL communicator each: the trainer's FSDP2 group, the worker's TP group
    contexts = {"cuda contexts (2 processes, est.)", "nccl communicators (fsdp2 of 8, tp of 2; est.)"}
    asleep = {"engine outside its sleep pool (est.)", "cuda graph pool, kept asleep (est.)"}
    # the sharding transient is gone (torch's cache emptied) before the engine claims its share: the larger counts
    assert set(by_name["startup"].parts) == {*contexts, "trainer params (fp32 shard)", "sync ring",
                                             "engine (gpu_memory_utilization)"}
    assert set(by_name["rollout"].parts) == {*contexts, "engine (gpu_memory_utilization)", "sync ring"}
    # 16 padded rows of 67 tokens: the step peaks in lm_head's backward, every layer's activations and the
    # padding masks kept, the head unsharded with its gradient, the next layer prefetched
    assert set(by_name["train"].parts) == {*contexts, "trainer params + grads + optimizer", "fsdp unsharded groups",
                                           "activations kept for backward", "logits and log-softmax",
                                           "attention masks", *asleep, "sync ring"}
    assert set(by_name["sync"].parts) == {*contexts, "trainer params + optimizer", "engine weights (woken)",
                                          *asleep, "sync ring", "gather buffer (largest group + send chunk)"}


def test_cuda_counts_the_trainers_communicator_at_every_world_size_and_graphs_only_when_captured():
    # world size 1 still makes a communicator: the gradient norm's and the finite checks' all-reduces
    _, one = cuda_phases("placement.num_slots=1", "engine.tp=1", "engine.enforce_eager=true",
                         plan=SwitchPlan(2, True, ""))
    assert one["train"].parts["nccl communicators (fsdp2 of 1; est.)"] == NCCL_COMMUNICATOR_BYTES
    assert one["train"].parts["cuda contexts (2 processes, est.)"] == 2 * CUDA_CONTEXT_BYTES
    assert "cuda graph pool, kept asleep (est.)" not in one["train"].parts
    _, two = cuda_phases("placement.num_slots=2", "engine.tp=2", plan=SwitchPlan(2, True, ""))
    assert two["train"].parts["nccl communicators (fsdp2 of 2, tp of 2; est.)"] == 2 * NCCL_COMMUNICATOR_PEERS_BYTES


def test_cuda_startup_peak_is_the_sharding_transient_when_it_outweighs_the_engine():
    _, by_name = cuda_phases("placement.num_slots=8", "engine.tp=2", "engine.gpu_memory_utilization=0.01",
                             plan=SwitchPlan(2, True, ""))
    parts = by_name["startup"].parts
    assert "sharding transient (largest group, fp32)" in parts and "engine (gpu_memory_utilization)" not in parts


def test_cuda_parts_are_per_gpu_shards_of_the_real_model():
    cfg, by_name = cuda_phases("placement.num_slots=8", "engine.tp=2", plan=SwitchPlan(2, True, ""))
    num_params, embedding = 7_615_616_512, 152064 * 3584 + 3584  # the largest group: lm_head + final norm
    peaks = predict_train_peaks(cfg, model_dims(cfg), device="cuda")
    assert peaks.resident_bytes == 12 * num_params // 8  # fp32 shard and AdamW's two moments
    grads = peaks.peak_parts.get("gradients (fp32 shard)", 0)  # those the step's largest moment holds
    assert by_name["train"].parts["trainer params + grads + optimizer"] == 12 * num_params // 8 + grads
    assert by_name["sync"].parts["trainer params + optimizer"] == 12 * num_params // 8
    assert by_name["sync"].parts["engine weights (woken)"] == num_params * 2 // 2  # bf16, TP=2
    assert by_name["sync"].parts["sync ring"] == 2 * embedding * 2 // 2  # 2 slots of the largest group's TP slice
    assert by_name["sync"].parts["gather buffer (largest group + send chunk)"] == embedding * 2 + embedding * 2 // 8
    assert by_name["rollout"].parts["engine (gpu_memory_utilization)"] == int(0.5 * H100)


def test_cuda_switches_move_exactly_what_they_say():
    plans = {(level, offload): cuda_phases("placement.num_slots=8", plan=SwitchPlan(level, offload, ""))[1]
             for level in (0, 2) for offload in (False, True)}
    awake, asleep = plans[0, False], plans[2, False]
    assert awake["rollout"].total - plans[0, True]["rollout"].total == 12 * 7_615_616_512 // 8
    assert awake["train"].total - asleep["train"].total == int(0.5 * H100) - ENGINE_ASLEEP_BYTES - CUDA_GRAPH_POOL_BYTES
    # nothing moves: the sync is the rollout's memory plus the gather buffer; train adds grads, activations and
    # FSDP's unsharded groups, and is the peak
    gather = awake["sync"].parts["gather buffer (largest group + send chunk)"]
    assert awake["sync"].total - awake["rollout"].total == gather
    assert max(awake.values(), key=lambda p: p.total).name == "train"
    # the sleeping engine wakes its weights for the sync, never its KV cache
    assert asleep["sync"].total < awake["sync"].total


@pytest.mark.parametrize("overrides, peak", [
    pytest.param(["placement.num_slots=8", "engine.gpu_memory_utilization=0.6"], "rollout",
                 id="big_engine_share_rollout_peaks"),
    pytest.param(["placement.num_slots=2", "engine.gpu_memory_utilization=0.2", "engine.tp=1"], "train",
                 id="few_slots_small_share_train_peaks"),
])
def test_cuda_peak_phase_with_a_sleeping_engine_and_a_resident_trainer(overrides, peak):
    # the sync never peaks here: it adds only the woken weights and the gather buffer to the trainer's state,
    # less than the engine's whole share that the rollout holds beside the same state
    _, by_name = cuda_phases(*overrides, plan=SwitchPlan(2, False, ""), gpu_bytes=H200)
    assert max(by_name.values(), key=lambda p: p.total).name == peak


# ------------------------------------------------------------------------------------------------ switch plan


@pytest.mark.parametrize("overrides, device, available, expected", [
    pytest.param([], "cpu", 16 * GIB, (0, False), id="tiny_on_big_machine_nothing_moves"),
    pytest.param(["model.preset=bench", "trainer.micro_batch_size=1", "engine.kv_cache_gib=2"], "cpu", 11 * GIB,
                 (2, True), id="bench_on_small_budget_sleeps_and_offloads"),
    pytest.param(["model.preset=bench", "trainer.micro_batch_size=1"], "cpu", 9.5 * GIB, (2, False),
                 id="bench_small_kv_cache_sleeps_trainer_stays"),
    pytest.param(["engine.sleep_level=1", "trainer.offload=true"], "cpu", 16 * GIB, (1, True),
                 id="user_choices_obeyed_though_nothing_needs_to_move"),
    pytest.param([f"model.path={QWEN_7B}", "engine.sleep_level=0", "trainer.offload=false",
                  "placement.num_slots=1", "engine.tp=1"], "cuda", H200, (0, False),
                 id="user_choices_obeyed_though_they_cannot_fit"),
    # 16 padded rows of 128 tokens per micro-batch in fp32 keep 24 GiB of activations and padding masks: no room
    # for the engine beside them
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2", "rollout.max_tokens=64"], "cuda",
                 H100, (2, False), id="qwen7b_8x80gib_engine_sleeps"),
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2", "trainer.micro_batch_size=1",
                  "trainer.mixed_precision=true", "engine.max_model_len=1024", "rollout.max_tokens=512"], "cuda",
                 H100, (0, False), id="qwen7b_8x80gib_short_answers_bf16_nothing_moves"),
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2",
                  "engine.gpu_memory_utilization=0.85"], "cuda", H100, (2, True),
                 id="qwen7b_8x80gib_big_engine_share_both_move"),
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=1",
                  "engine.gpu_memory_utilization=0.7"], "cuda", H100, (2, False),
                 id="qwen7b_8x80gib_engine_sleeps_trainer_stays"),
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=1", "engine.tp=1"], "cuda", H200, (2, True),
                 id="qwen7b_1xh200_everything_moves"),
])
def test_plan_switch(overrides, device, available, expected):
    cfg = load_config(None, overrides)
    plan = plan_switch(cfg, model_dims(cfg), device=device, available_bytes=available)
    assert (plan.engine_sleep_level, plan.trainer_offload) == expected
    assert "\n" not in plan.reason and plan.reason


def test_the_chosen_plan_is_what_preflight_checks():
    cfg = load_config(None, ["model.preset=bench", "trainer.micro_batch_size=1", "engine.kv_cache_gib=2"])
    result = preflight(cfg, model_dims(cfg), device="cpu", available_bytes=11 * GIB)  # fits only because both move
    assert (result.plan.engine_sleep_level, result.plan.trainer_offload) == (2, True)
    assert result.phases == predict_phases(cfg, model_dims(cfg), device="cpu", plan=result.plan)
    awake = load_config(None, ["model.preset=bench", "trainer.micro_batch_size=1", "engine.kv_cache_gib=2",
                               "engine.sleep_level=0"])
    with pytest.raises(ConfigError, match="phase 'train'.*use engine.sleep_level=auto or 2 \\(now 0"):
        preflight(awake, model_dims(awake), device="cpu", available_bytes=11 * GIB)


def test_unknown_model_dims_move_everything_unless_chosen():
    hub = load_config(None, ["model.path=Qwen/Qwen2.5-7B"])
    assert model_dims(hub) is None  # not on this machine
    plan = plan_switch(hub, None, device="cuda", available_bytes=H100)
    assert (plan.engine_sleep_level, plan.trainer_offload) == (2, True) and "unknown" in plan.reason
    chosen = plan_switch(load_config(None, ["model.path=Qwen/Qwen2.5-7B", "engine.sleep_level=1",
                                            "trainer.offload=false"]), None, device="cuda", available_bytes=H100)
    assert (chosen.engine_sleep_level, chosen.trainer_offload) == (1, False)


# ------------------------------------------------------------------------------- validate for a GPU node


def test_validate_predicts_for_a_gpu_node_not_present(capsys):
    # the README's 7B command
    code = main(["validate", f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2",
                 "engine.max_model_len=4096", "rollout.max_tokens=1024", "trainer.micro_batch_size=1",
                 "--gpus", "8", "--gpu-memory-gib", "79.6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "# 8 cuda slot(s), 4 engine(s) x TP=2, FSDP2 over 8 rank(s)" in out
    assert "# switch plan: engine sleep level 2, trainer offload false" in out
    assert "budget 77.2 of 79.6 GiB" in out
    for name in ("startup", "rollout", "train", "sync"):
        assert any(line.startswith(f"#   {name} ") for line in out.splitlines()), name
    assert "<- peak" in out


@pytest.mark.parametrize("argv, expected", [
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=1", "engine.tp=1", "--gpus", "1",
                  "--gpu-memory-gib", "79.6"], "memory preflight: phase 'train'", id="7b_on_one_h100"),
    pytest.param([f"model.path={QWEN_7B}", "placement.num_slots=8", "--gpus", "4", "--gpu-memory-gib", "80"],
                 "placement.num_slots=8 is invalid: the node of --gpus 4 has 4 GPUs", id="more_slots_than_gpus"),
    pytest.param(["--gpus", "8"], "--gpus and --gpu-memory-gib go together", id="gpus_without_size"),
    pytest.param(["placement.device=cpu", "--gpus", "8", "--gpu-memory-gib", "80"], "placement.device='cpu'",
                 id="cpu_device_with_gpus"),
])
def test_validate_for_a_gpu_node_refuses_with_one_line(capsys, argv, expected):
    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("colocate: error: ") and expected in err


def test_validate_with_unknown_dims_prints_the_plan_and_no_prediction(capsys):
    code = main(["validate", "model.path=Qwen/Qwen2.5-7B", "--gpus", "8", "--gpu-memory-gib", "80"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "# switch plan: engine sleep level 2, trainer offload true" in out and "none" in out


# ------------------------------------------------------------------------- the train step, measured on an H200

# One H200 (torch 2.11, NCCL 2.28.9), TrainerActor at world size 1 on NCCL: Qwen2.5-7B's width cut to 4 layers
# (2.02B parameters with its 152k vocabulary), one sequence of a 64-token prompt and the rest answer. The peak of
# forward+backward over the resident state (torch's allocated bytes; issue 40's table). AdamW's foreach step on
# the same runs held one fp32 copy of the parameters, 7.54 GiB, beside the gradients.
BF16_CHECKPOINTED = ["trainer.mixed_precision=true", "trainer.activation_checkpointing=true",
                     "trainer.logprob_chunk_tokens=1024"]
BF16 = ["trainer.mixed_precision=true", "trainer.activation_checkpointing=false", "trainer.logprob_chunk_tokens=1024"]
FP32_FULL_LOGITS = ["trainer.mixed_precision=false", "trainer.activation_checkpointing=false",
                    "trainer.logprob_chunk_tokens=null"]
H200_TRAIN_STEPS = [
    (BF16_CHECKPOINTED, 4096, 9.57), (BF16_CHECKPOINTED, 8192, 9.57), (BF16_CHECKPOINTED, 16384, 10.89),
    (BF16_CHECKPOINTED, 32768, 15.71), (BF16, 4096, 9.57), (BF16, 8192, 12.14), (FP32_FULL_LOGITS, 4096, 23.48),
]
ADAMW_FOREACH_TEMPORARIES_GIB = 7.54


@pytest.fixture(scope="module")
def four_layer_qwen(tmp_path_factory) -> str:
    import json

    config = json.loads((Path(QWEN_7B) / "config.json").read_text())
    path = tmp_path_factory.mktemp("qwen7b-4-layers")
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return str(path)


@pytest.mark.parametrize("trainer, tokens, measured_gib", H200_TRAIN_STEPS,
                         ids=[f"{'-'.join(k.split('=')[1] for k in t)}-{n}" for t, n, _ in H200_TRAIN_STEPS])
def test_the_train_step_is_predicted_within_15_percent_of_the_h200(four_layer_qwen, trainer, tokens, measured_gib):
    from colocate.job.preflight import PROMPT_TOKENS

    cfg = load_config(None, [f"model.path={four_layer_qwen}", "placement.num_slots=1", "engine.tp=1",
                             "trainer.micro_batch_size=1", f"rollout.max_tokens={tokens - PROMPT_TOKENS}",
                             f"engine.max_model_len={tokens}", *trainer])
    dims = model_dims(cfg)
    assert 2.02e9 < dims.num_params < 2.03e9
    peaks = predict_train_peaks(cfg, dims, device="cuda")
    assert abs(measured_gib * GIB / peaks.forward_backward_bytes - 1) <= 0.15, peaks.forward_backward_moment
    # AdamW's step alongside: the gradients and one fp32 copy of the shard, above forward+backward in bf16 up to
    # 16k tokens
    temporaries = peaks.optimizer_step_parts["adamw foreach temporaries (one fp32 copy of the shard)"]
    assert abs(ADAMW_FOREACH_TEMPORARIES_GIB * GIB / temporaries - 1) <= 0.15
    assert peaks.optimizer_step_bytes == 4 * dims.num_params + temporaries
    assert (peaks.optimizer_step_bytes > peaks.forward_backward_bytes) == (tokens <= 16384
                                                                           and trainer is not FP32_FULL_LOGITS)


# ------------------------------------------------------------------------------------ what the preflight missed


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda_graphs"])
def test_an_asleep_reward_model_keeps_its_context_communicator_and_cuda_graphs(eager):
    served = ["rollout.rewards=model:tiny-rm", "reward_model.tp=2", f"engine.enforce_eager={str(eager).lower()}"]
    _, alone = cuda_phases("placement.num_slots=8", "engine.tp=2", served[-1], plan=SwitchPlan(2, True, ""))
    _, beside = cuda_phases("placement.num_slots=8", "engine.tp=2", *served, plan=SwitchPlan(2, True, ""))
    asleep = beside["train"].parts
    outside_its_pool = CUDA_CONTEXT_BYTES + NCCL_COMMUNICATOR_PEERS_BYTES + ENGINE_ASLEEP_BYTES
    assert asleep["reward model's tp communicator (2 ranks, est.)"] == NCCL_COMMUNICATOR_PEERS_BYTES
    assert ("reward model's cuda graph pool, kept asleep (est.)" in asleep) is not eager
    assert beside["train"].total - alone["train"].total == outside_its_pool + (0 if eager else CUDA_GRAPH_POOL_BYTES)
    # awake (the rollout), its communicator lies outside its budget too, as the policy engine's does
    assert beside["rollout"].parts["reward model's tp communicator (2 ranks, est.)"] == NCCL_COMMUNICATOR_PEERS_BYTES


def test_a_split_placement_predicts_its_engine_gpus_and_refuses_one_that_cannot_hold_its_engine():
    split = ["placement.num_slots=8", "placement.engine_slots=4", "engine.tp=2"]
    cfg, by_name = cuda_phases(*split, plan=SwitchPlan(0, False, ""))
    engine = by_name["engine gpu"].parts
    # vLLM's share, and what it does not count: the worker's context, its TP and broadcast groups, its ring
    assert engine["engine (gpu_memory_utilization)"] == int(0.5 * H100)
    assert engine["nccl communicators (tp of 2, broadcast of 3; est.)"] == 2 * NCCL_COMMUNICATOR_PEERS_BYTES
    assert engine["sync ring"] == by_name["sync"].parts["broadcast staging (the TP ranks it feeds)"] // 1
    assert engine["cuda context (engine worker, est.)"] == CUDA_CONTEXT_BYTES
    preflight(cfg, model_dims(cfg), device="cuda", available_bytes=H100)  # fits
    crowded = load_config(None, [f"model.path={QWEN_7B}", *split, "engine.gpu_memory_utilization=0.97"])
    with pytest.raises(ConfigError, match="phase 'engine gpu'.*lower engine.gpu_memory_utilization \\(now 0.97\\)"):
        preflight(crowded, model_dims(crowded), device="cuda", available_bytes=H100)


@pytest.mark.parametrize("mixed_precision", [True, False], ids=["bf16", "fp32"])
def test_the_reference_policy_is_counted_on_the_gpu_and_in_host_memory(mixed_precision):
    # algo.kl_coef > 0: a second copy of the weights, offloaded but for its forwards at the start of each step
    overrides = ["placement.num_slots=1", "engine.tp=1", f"trainer.mixed_precision={str(mixed_precision).lower()}",
                 "trainer.activation_checkpointing=true", "trainer.micro_batch_size=1", "rollout.max_tokens=64"]
    cfg, _ = cuda_phases(*overrides, plan=SwitchPlan(2, True, ""))
    with_kl, _ = cuda_phases(*overrides, "algo.kl_coef=0.05", plan=SwitchPlan(2, True, ""))
    dims, c = model_dims(cfg), 2 if mixed_precision else 4
    plain, reference = (predict_train_peaks(job, dims, device="cuda") for job in (cfg, with_kl))
    assert "reference forward" not in plain.moments
    parts = reference.moments["reference forward"]
    assert parts["reference policy (compute-dtype shard)"] == c * dims.num_params  # one rank's shard
    # it runs before the policy's activations and gradients exist: a moment of its own, which in fp32 comes
    # within 2% of the step's end (every fp32 gradient and the embeddings' reduce-scatter)
    assert reference.forward_backward_bytes == max(plain.forward_backward_bytes, sum(parts.values()))
    assert sum(parts.values()) > (0.95 if c == 4 else 0.5) * plain.forward_backward_bytes
    host = preflight(with_kl, dims, device="cuda", available_bytes=int(1000 * GIB)).host_needs
    assert host["reference policy's host copy (offloaded)"] == c * dims.num_params
    assert "reference policy's host copy (offloaded)" not in preflight(
        cfg, dims, device="cuda", available_bytes=int(1000 * GIB)).host_needs


def test_the_switch_bench_predicts_the_sequences_it_trained():
    # bench switch's two steps train the task's own sequences, a few tokens each: their prediction pictures those,
    # where the config's bound pictures every row at 64 + rollout.max_tokens
    from colocate.bench.switch import as_run
    from colocate.job.preflight import train_micro_batch_shape

    cfg = load_config(None, ["model.preset=bench", "rollout.max_tokens=32"])
    ran = as_run(cfg, [(4, 3), (2, 5), (4, 1)])
    assert train_micro_batch_shape(cfg) == (16, 96, True)
    assert train_micro_batch_shape(ran) == (16, 9, True)  # the longest prompt and the longest answer
    assert as_run(cfg, []) is cfg
    bound, trained = (predict_train_peaks(c, model_dims(c), device="cpu") for c in (cfg, ran))
    assert trained.forward_backward_bytes < bound.forward_backward_bytes


# ------------------------------------------------------------------------------------------- the critic

PPO_PRESET = str(Path(__file__).resolve().parents[2] / "configs" / "algos" / "ppo.yaml")


def test_validate_prints_the_critics_parts_for_the_readme_7b_job_with_the_ppo_preset(capsys):
    code = main(["validate", PPO_PRESET, f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2",
                 "engine.max_model_len=4096", "rollout.max_tokens=1024", "trainer.micro_batch_size=1",
                 "--gpus", "8", "--gpu-memory-gib", "79.6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = {name: next(line for line in out.splitlines() if line.startswith(f"#   {name} "))
             for name in ("startup", "rollout", "train", "sync")}
    # Qwen2.5-7B less its untied 152064 x 3584 head, plus a 3585-parameter value head: 7.07B, 12 bytes each
    # (fp32 and AdamW's moments) over 8 ranks
    critic = 7_615_616_512 - 152_064 * 3584 + 3585
    assert f"critic params + optimizer {12 * critic / 8 / GIB:.2f}" in lines["rollout"]
    for name in ("train", "sync"):
        assert f"critic params + optimizer {12 * critic / 8 / GIB:.2f}" in lines[name], name
    assert f"critic params (fp32 shards) {4 * critic / 8 / GIB:.2f}" in lines["startup"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_critic_is_counted_in_every_phase_and_offloaded_with_the_policy(device):
    from colocate.job.phases import critic_parts

    base = [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2"]
    ppo = [*base, "algo.advantage=gae", "critic.model_path=policy"]
    plan = SwitchPlan(2, True, "test")
    configs = [load_config(None, o) for o in (base, ppo)]
    without, with_ = (predict_phases(cfg, model_dims(cfg), device=device, plan=plan, gpu_bytes=H200)
                      for cfg in configs)
    parts = critic_parts(configs[1], model_dims(configs[1]), ranks=1 if device == "cuda" else 8)
    assert set(parts) == {"startup", "rollout", "train", "sync"}
    for a, b in zip(without, with_):
        added = {k: v for k, v in b.parts.items() if k not in a.parts}
        expected = {k: 0 for k in parts["rollout"]} if a.name == "rollout" else parts.get(a.name, {})
        assert added == expected, a.name  # offloaded: nothing of it beside the engine in the rollout
        assert b.total - a.total == sum(expected.values()), a.name


def test_the_delta_sync_stores_are_counted_on_the_host():
    from colocate.job.phases import DELTA_STORES
    from colocate.host.node_checks import host_needs
    from colocate.job.phases import delta_store_bytes

    split = [f"model.path={QWEN_7B}", "placement.num_slots=8", "placement.engine_slots=4", "engine.tp=2"]
    for delta, expected in (("auto", True), ("true", True), ("false", False)):
        cfg = load_config(None, [*split, f"sync.delta={delta}"])
        dims = model_dims(cfg)
        stores = delta_store_bytes(cfg, dims)
        # the feeders' copy of the whole model in bf16, and each of the 2 engines' own
        assert stores == (3 * dims.num_params * 2 if expected else 0), delta
        cpu = predict_phases(cfg, dims, device="cpu", plan=SwitchPlan(0, False, "split"))
        assert [p.parts.get(DELTA_STORES, 0) for p in cpu] == [0] + [stores] * 3, delta
        needs = host_needs(cfg, dims, offload=True, delta_store_bytes=stores)
        if expected:  # held beside the offloaded state's host copy, from the first sync on
            assert needs["trainer state's host copy (offload) + delta weight stores (sync.delta)"] == \
                12 * dims.num_params + stores
    colocated = load_config(None, [f"model.path={QWEN_7B}", "placement.num_slots=8", "engine.tp=2"])
    assert delta_store_bytes(colocated, model_dims(colocated)) == 0  # auto is off co-located
