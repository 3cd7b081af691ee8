"""placement.engine_slots=auto (job/split.py): decided once, before any actor, into the int every reader of the slots
expects; the simulator's fastest split where it predicts the job's GPUs, the most even split where nothing predicts,
co-located in sync mode; and one line where no split fits."""

from __future__ import annotations

import pytest

from colocate.cli import main
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.job.checks import GpuNode
from colocate.job.preflight import SwitchPlan
from colocate.job.resolve import place_engines, resolve_job
from colocate.job.setup import check_job
from colocate.job.split import SplitPredictor, StepPrediction, choose_engine_slots
from colocate.simulate.split import split_predictor

QWEN = "tests/data/model_configs/Qwen2.5-0.5B-Instruct"  # a config.json, no weights
OVERLAPPED = ["algo.mode=one_step_off", "placement.engine_slots=auto"]


def auto(num_slots: int, tp: int, *more: str):
    return load_config(None, [*OVERLAPPED, f"placement.num_slots={num_slots}", f"engine.tp={tp}", *more])


def test_the_default_stays_co_located():
    assert load_config(None, []).placement.engine_slots == 0


@pytest.mark.parametrize("num_slots, tp, slots, says", [
    pytest.param(2, 1, 1, "the only split of placement.num_slots=2 into whole engines of engine.tp=1 that leaves "
                 "the trainers a slot: engines on 1 slot, trainers on 1 slot", id="two_slots_one_split"),
    pytest.param(4, 1, 2, "no model ranks splits on the CPU (a calibration measures one layout): the most even "
                 "split, engines on 2 slots, trainers on 2 slots, whose step is at most 2x the best split's",
                 id="even"),
    pytest.param(3, 1, 2, "engines on 2 slots, trainers on 1 slot, whose step is at most 3x", id="tie_to_engines"),
    pytest.param(8, 2, 4, "engines on 4 slots, trainers on 4 slots", id="whole_engines_of_tp2"),
    pytest.param(6, 4, 4, "the only split of placement.num_slots=6 into whole engines of engine.tp=4",
                 id="one_engine_of_tp4"),
])
def test_without_a_prediction_the_most_even_split(num_slots, tp, slots, says):
    """Step ~ max(R / E, T / (N - E)): with R and T unknown, the most even split is never far from the best."""
    chosen, why = choose_engine_slots(auto(num_slots, tp), device="cpu")
    assert chosen == slots and says in why


def test_sync_mode_is_co_located_and_says_why():
    resolved = resolve_job(load_config(None, ["placement.engine_slots=auto"]), switch=SwitchPlan(2, True, "x; y"))
    assert resolved.config.placement.engine_slots == 0 and resolved.sync_method == "in_place"
    (decision,) = [d for d in resolved.decisions if d.key == "placement.engine_slots"]
    assert decision.value == "0" and decision.why.startswith("algo.mode=sync runs rollout and training in turn")
    assert [d.key for d in resolved.decisions][:2] == ["placement.device", "placement.engine_slots"]


def fake_predictor(steps: dict[int, float | None]) -> SplitPredictor:
    """The step of each split (None: it does not fit), the same tokens trained by every one."""
    def predict(job):
        step = steps[job.placement.engine_slots]
        return None if step is None else StepPrediction(step, 1000.0 / step)

    return SplitPredictor(where="4 x Fake GPU", note="a fake's prediction", predict=predict)


def test_a_prediction_picks_the_fastest_and_says_so():
    slots, why = choose_engine_slots(auto(4, 1), device="cuda", predictor=fake_predictor({1: 5.0, 2: 3.0, 3: None}))
    assert slots == 2
    assert why == ("the split predicted fastest on 4 x Fake GPU: engines on 2 slots, trainers on 2 slots, 3 s a step "
                   "(engine+trainer slots: 1+3 5 s, 3+1 does not fit); a fake's prediction")


def test_when_no_split_fits_the_prediction_the_rule_decides():
    slots, why = choose_engine_slots(auto(4, 1), device="cuda", predictor=fake_predictor(dict.fromkeys((1, 2, 3))))
    assert slots == 2 and why.startswith("no split fits the simulator's memory check on 4 x Fake GPU: the most even")


def test_the_simulator_predicts_each_split_on_a_described_gpu_node():
    cfg = load_config(None, [f"model.path={QWEN}", *OVERLAPPED, "placement.num_slots=4", "engine.tp=1",
                             "rollout.max_tokens=1000", "engine.max_model_len=1100", "rollout.num_prompts=32",
                             "trainer.activation_checkpointing=true", "trainer.micro_batch_size=1"])
    predictor = split_predictor(cfg, gpu_name="h100", memory_gib=80.0)
    placed, (decision,) = place_engines(cfg, device="cuda", predictor=predictor)
    assert placed.placement.engine_slots in (1, 2, 3) and cfg.placement.engine_slots == "auto"
    assert decision.why.startswith("the split predicted fastest on 4 x H100 SXM 80GB: engines on ")
    assert "a model: answers log-normal around 250 tokens" in decision.why
    assert split_predictor(load_config(None, [f"model.path={QWEN}"]), gpu_name="h100") is None  # nothing to choose
    assert split_predictor(cfg) is None  # this machine has no GPU the simulator models


def test_check_job_decides_before_the_slots_are_planned():
    """The slot plan, the preflight and every later step read the decided int; the user's config keeps auto."""
    cfg = load_config(None, ["model.preset=tiny", *OVERLAPPED, "placement.num_slots=4", "engine.tp=1"])
    checked = check_job(cfg, node=GpuNode(4, 80.0), predictor=split_predictor(cfg, gpu_name="h100", memory_gib=80))
    slots = checked.config.placement.engine_slots
    assert slots in (1, 2, 3) and checked.slots.num_trainer_ranks == 4 - slots
    assert checked.resolved.config.placement.engine_slots == slots and checked.resolved.sync_method == "broadcast"
    assert [d.key for d in checked.placed] == ["placement.engine_slots"]
    assert cfg.placement.engine_slots == "auto"


@pytest.mark.parametrize("overrides, line", [
    pytest.param(OVERLAPPED, "placement.engine_slots='auto' is invalid: picks a split of placement.num_slots=2 into "
                 "whole engines of engine.tp=2 workers and at least one trainer slot, and there is none; valid: "
                 "engine.tp=1 with it, placement.num_slots >= 3, or 0 (co-located)", id="tp_takes_every_slot"),
    pytest.param([*OVERLAPPED, "placement.num_slots=1"], "placement.engine_slots='auto' is invalid: picks a split of "
                 "placement.num_slots=1 into whole engines of engine.tp=2 workers and at least one trainer slot, and "
                 "there is none; valid: placement.engine_slots=0 engine.tp=1 (co-located), or more slots",
                 id="one_slot"),
    pytest.param([*OVERLAPPED, "engine.tp=1", "sync.method=gather"], "sync.method='gather' is invalid: a split "
                 "placement's engines share no device with a trainer, so the sync is broadcast to them over a process "
                 "group; valid with placement.engine_slots > 0: auto, broadcast", id="a_key_no_split_allows"),
    pytest.param(["placement.engine_slots=half"], "placement.engine_slots='half' is invalid: expected an integer, "
                 "or auto", id="neither_int_nor_auto"),
    pytest.param(["placement.engine_slots=1.5"], "placement.engine_slots=1.5 is invalid: expected an integer, or "
                 "auto", id="a_fraction"),
    pytest.param(["placement.engine_slots=-1"], "placement.engine_slots=-1 is invalid: must be >= 0 (0: co-located, "
                 "N: the engines' slots of a split), or auto (the split predicted fastest)", id="negative"),
])
def test_bad_input_is_one_line_before_any_actor(overrides, line, capsys):
    with pytest.raises(ConfigError) as raised:
        load_config(None, overrides)
    assert str(raised.value) == line
    assert main(["validate", *overrides]) == 2
    assert capsys.readouterr().err.strip() == f"colocate: error: {line}"


def test_validate_prints_the_decision(capsys):
    assert main(["validate", *OVERLAPPED, "engine.tp=1"]) == 0
    out = capsys.readouterr().out
    assert "  engine_slots: auto\n" in out  # the config as the user gave it
    assert "# 2 cpu slot(s), 1 engine(s) x TP=1, FSDP2 over 1 rank(s), split: no slot holds both" in out
    assert ("#   placement.engine_slots: 1 (the only split of placement.num_slots=2 into whole engines of "
            "engine.tp=1 that leaves the trainers a slot: engines on 1 slot, trainers on 1 slot)\n") in out


def test_validate_on_a_described_gpu_node_prints_the_predicted_split(capsys):
    assert main(["validate", *OVERLAPPED, "placement.num_slots=4", "engine.tp=1", "--gpus", "4",
                 "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "#   placement.engine_slots: " in out and "(the split predicted fastest on 4 x H100 SXM 80GB: " in out


def test_simulate_decides_auto_as_launch_does(capsys, tmp_path):
    code = main(["simulate", f"model.path={QWEN}", *OVERLAPPED, "engine.tp=1", "rollout.num_prompts=8",
                 "trainer.micro_batch_size=1", "--gpus", "4", "--lengths", "lognormal:64,0.9,16,256",
                 "--prompt-tokens", "32", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("placement.engine_slots: ")
    assert "the split predicted fastest on 4 x H100 SXM 80GB" in out and "a model: answers lognormal:64" in out


def test_validate_for_a_ray_cluster_decides_by_the_rule(capsys):
    """A cluster's devices are known once it is reached (no connection here): the split is still decided before
    any actor, and every later step reads it."""
    assert main(["validate", "--address", "127.0.0.1:6379", *OVERLAPPED, "placement.num_slots=4", "engine.tp=1"]) == 0
    out = capsys.readouterr().out
    assert "# 4 slot(s) on the Ray cluster at 127.0.0.1:6379, 2 engine(s) x TP=1" in out
    assert ("# placement.engine_slots: 2 (a Ray cluster's devices are known once it is reached: the most even split, "
            "engines on 2 slots, trainers on 2 slots, whose step is at most 2x the best split's") in out
