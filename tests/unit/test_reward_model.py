"""Rewards from a model, without its engine: the component syntax, what the model reads, how a judge's verdict
is read, the placement it shares, the preflight's count of it, and each bad input as one line."""

from __future__ import annotations

import json

import pytest

from colocate.config import load_config
from colocate.config.reward_model import RewardModelSpec, reward_model_spec, reward_models_in
from colocate.engine.reward_engine import classifier_inputs, judge_inputs, keep_last, parse_verdict
from colocate.errors import ConfigError
from colocate.job.checks import check_sources
from colocate.job.placement import (
    ENGINE_SHARE,
    REWARD_MODEL_SHARE,
    TRAINER_SHARE,
    SlotPlan,
    engine_placement,
    plan_slots,
    reward_model_placement,
)
from colocate.job.preflight import ModelDims, predict_phases
from colocate.models.sources import build_tokenizer
from colocate.rl.rewards import CombinedReward, make_reward, parse_rewards
from colocate.rl.tasks import make_task


@pytest.mark.parametrize("item, spec", [
    ("model:tiny-rm", RewardModelSpec("model", "tiny-rm", 1.0)),
    ("model:/models/rm:0.5", RewardModelSpec("model", "/models/rm", 0.5)),
    (" judge:Org/Judge-7B:-2 ", RewardModelSpec("judge", "Org/Judge-7B", -2.0)),
    ("judge:/a:b", RewardModelSpec("judge", "/a:b", 1.0)),  # ":b" is no weight: part of the path
    ("math:1.0", None),
    ("models.mine:score", None),  # a plug-in whose module merely starts with "model"
    ("model", None),
])
def test_a_component_names_a_reward_model(item, spec):
    assert reward_model_spec(item) == spec


def test_the_model_component_is_bound_to_the_served_model():
    class Served:
        batched, kind = True, "model"

        def __call__(self, prompts, responses, answers):
            return [float(len(r)) for r in responses]

    components = parse_rewards("exact,model:tiny-rm:0.5")
    assert [(c.name, c.fn is None, c.weight, c.model_path) for c in components] == \
        [("exact", False, 1.0, ""), ("model", True, 0.5, "tiny-rm")]
    cfg = load_config(None, ["rollout.rewards=exact,model:tiny-rm:0.5"])
    reward = make_reward(cfg, make_task("copy", length=3), Served())
    assert isinstance(reward, CombinedReward)
    out = reward(["p", "q"], ["ab", "xyz"], ["ab", "x"])
    assert out.total == [1.0 + 0.5 * 2, 0.5 * 3] and out.components["model"] == [2.0, 3.0]


def test_a_classifier_reads_prompt_then_answer_and_a_judge_its_filled_prompt():
    tokenizer = build_tokenizer()  # the presets' character tokenizer: no chat template, plain text
    assert classifier_inputs(tokenizer, ["1+1="], ["2"]) == [tokenizer.encode("1+1=2", add_special_tokens=False)]
    assert judge_inputs(tokenizer, "q {prompt} a {response} r {answer}: ", ["ab"], ["c"], ["d"]) == \
        [tokenizer.encode("q ab a c r d: ", add_special_tokens=False)]
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                               "{% if add_generation_prompt %}a:{% endif %}")
    assert classifier_inputs(tokenizer, ["1+1="], ["2"]) == [tokenizer.encode("u:1+1=;a:2;", add_special_tokens=False)]
    assert judge_inputs(tokenizer, "{prompt}{response}", ["x"], ["y"], ["z"]) == \
        [tokenizer.encode("u:xy;a:", add_special_tokens=False)]


def test_a_long_input_keeps_its_end():
    assert keep_last([[1, 2, 3, 4], [5]], 3) == ([[2, 3, 4], [5]], 1)


@pytest.mark.parametrize("verdict, pattern, value", [
    ("score: 0.8 out of 1", r"-?\d+(?:\.\d+)?", 0.8),
    ("i give it 7/10", r"(\d+)/10", 7.0),
    ("no number here", r"-?\d+(?:\.\d+)?", None),
    ("verdict: good", r"verdict: (\w+)", None),  # a match that is not a number
    ("1" * 400, r"\d+", None),  # float() gives inf: no score
])
def test_a_verdict_is_read_as_its_first_number(verdict, pattern, value):
    assert parse_verdict(verdict, pattern) == value


def test_the_reward_model_shares_the_engines_first_slots():
    cfg = load_config(None, ["rollout.rewards=model:tiny-rm", "placement.num_slots=4", "engine.tp=2",
                             "reward_model.tp=2"])
    plan = plan_slots(cfg, device="cuda", num_devices=4)
    assert plan.reward_model_slots() == [0, 1]
    where = reward_model_placement(plan)
    assert (where.bundle, where.driver_share, where.env["VLLM_RAY_BUNDLE_INDICES"]) == (0, 0.0, "0,1")
    assert where.env["VLLM_RAY_PER_WORKER_GPUS"] == str(REWARD_MODEL_SHARE)
    engine = engine_placement(plan, 0)
    assert float(engine.env["VLLM_RAY_PER_WORKER_GPUS"]) + REWARD_MODEL_SHARE + TRAINER_SHARE <= 1
    without = plan_slots(load_config(None, ["placement.num_slots=4", "engine.tp=2"]), device="cuda", num_devices=4)
    assert engine_placement(without, 0).cpu_share == ENGINE_SHARE  # without one, the engines keep their share
    assert plan.describe()[1].endswith("engine 0 tp worker 0 | reward model tp worker 0")
    split = SlotPlan("cpu", 4, 1, num_split_engine_slots=2, reward_model_tp=1)
    assert split.reward_model_slots() == [2]  # beside the engines, never the trainers


def test_the_preflight_counts_the_reward_model():
    dims = ModelDims.from_config_dict(json.loads(
        open("tests/data/model_configs/Qwen2.5-0.5B-Instruct/config.json").read()))
    plain = load_config(None, ["placement.device=cuda", "engine.sleep_level=1"])
    served = load_config(None, ["placement.device=cuda", "engine.sleep_level=1", "rollout.rewards=model:tiny-rm",
                                "reward_model.gpu_memory_utilization=0.2"])
    gpu = 80 << 30
    before = {p.name: p.total for p in predict_phases(plain, dims, device="cuda", gpu_bytes=gpu)}
    after = {p.name: p for p in predict_phases(served, dims, device="cuda", gpu_bytes=gpu)}
    assert after["rollout"].total - before["rollout"] >= int(0.2 * gpu)  # awake beside the rollout
    assert after["startup"].total - before["startup"] >= int(0.2 * gpu)  # it starts beside everything
    assert 0 < after["train"].total - before["train"] < int(0.2 * gpu)  # asleep while the trainer trains
    cpu = {p.name: p.parts for p in predict_phases(served, dims, device="cpu")}
    assert all("reward model (processes + kv cache)" in parts for parts in cpu.values())


def _model_dir(tmp_path, name: str, **config) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_bad_reward_models_are_one_line_before_any_actor(tmp_path):
    causal = _model_dir(tmp_path, "lm", architectures=["Qwen2ForCausalLM"])
    two_labels = _model_dir(tmp_path, "cls2", architectures=["Qwen2ForSequenceClassification"],
                            id2label={"0": "a", "1": "b"})
    classifier = _model_dir(tmp_path, "rm", architectures=["Qwen2ForSequenceClassification"], id2label={"0": "s"})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": [')
    cases = {
        f"model:{tmp_path}/missing": "no such directory",
        f"model:{causal}": "is not a sequence classifier",
        f"model:{two_labels}": "the classifier has 2 labels",
        f"judge:{classifier}": "does not generate",
        "model:tiny-nothing": "no such directory",
        f"model:{broken}": r"its config.json cannot be read \(JSONDecodeError",
    }
    for spec, why in cases.items():
        cfg = load_config(None, [f"rollout.rewards={spec}", f"logging.output_dir={tmp_path}/out"])
        with pytest.raises(ConfigError, match=why) as raised:
            check_sources(cfg)
        assert "\n" not in str(raised.value) and str(raised.value).startswith("rollout.rewards=")
    for spec in (f"model:{classifier}", f"judge:{causal}", "model:tiny-rm", "judge:tiny", "model:Org/Name"):
        check_sources(load_config(None, [f"rollout.rewards={spec}", f"logging.output_dir={tmp_path}/out"]))


@pytest.mark.parametrize("overrides, key", [
    (["rollout.rewards=model:tiny-rm,judge:tiny"], "rollout.rewards"),
    (["rollout.rewards=model:"], "rollout.rewards"),
    (["rollout.rewards=model:tiny-rm", "reward_model.tp=3"], "reward_model.tp"),
    (["rollout.rewards=judge:tiny", "reward_model.judge_max_tokens=128"], "reward_model.judge_max_tokens"),
    (["reward_model.verdict_pattern=(unclosed"], "reward_model.verdict_pattern"),
    (["reward_model.judge_prompt={question}"], "reward_model.judge_prompt"),
    (["reward_model.gpu_memory_utilization=1.0"], "reward_model.gpu_memory_utilization"),
])
def test_bad_reward_model_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}=") as raised:
        load_config(None, overrides)
    assert "\n" not in str(raised.value)


def test_only_a_named_model_is_served():
    assert reward_models_in("math:1,format:0.1") == []
    assert reward_models_in("math,judge:tiny:0.2") == [RewardModelSpec("judge", "tiny", 0.2)]
