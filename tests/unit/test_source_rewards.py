"""Per-source rewards and metrics (rollout.source_rewards, data.source_key; rl/rewards.py SourceRewards): each row's
source picks the rewards that score it, the metrics are per source as well as in total, and a source without a
reward is one line before anything starts."""

from __future__ import annotations

import json
import math

import pytest

from colocate.config import ConfigError, load_config
from colocate.job.checks import check_sources, read_inputs
from colocate.models.sources import build_tokenizer
from colocate.rl.data import make_prompt_source
from colocate.rl.rewards import make_reward
from colocate.rl.samples import Answer, Group
from colocate.rl.scoring import Scored, reward_groups
from colocate.rl.tasks import Sample, make_task

SPEC = '{"arith": "math:1.0,exact:0.5", "*": "exact"}'


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def two_sources(tmp_path) -> str:
    return write_rows(tmp_path / "mixed.jsonl", [
        {"prompt": "1+1=", "answer": "2", "data_source": "arith"},
        {"prompt": "say hi", "answer": "hi", "data_source": "chat"},
    ] * 4)


def job(tmp_path, *overrides):
    spec = [] if any(o.startswith("rollout.source_rewards=") for o in overrides) else [f"rollout.source_rewards={SPEC}"]
    return load_config(None, [f"data.train_files={two_sources(tmp_path)}", "rollout.num_prompts=2", *spec,
                              *overrides])


def group(sample: Sample, texts: list[str], tokenizer) -> Group:
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    return Group(sample, [1], [Answer(0, 16, token_ids=i, logprobs=[-1.0] * len(i), finish_reason="stop")
                               for i in ids])


def test_each_source_is_scored_by_its_own_rewards_and_reported_apart(tmp_path):
    tokenizer = build_tokenizer()
    cfg = job(tmp_path)
    samples = make_prompt_source(cfg, tokenizer).next_batch(2)
    assert {s.source for s in samples} == {"arith", "chat"}
    reward = make_reward(cfg, make_task(cfg.rollout.task, length=cfg.rollout.task_length))
    arith = next(s for s in samples if s.source == "arith")
    chat = next(s for s in samples if s.source == "chat")
    # arith: math (1.0) and exact (0.5); chat ("*"): exact alone
    groups = [group(arith, ["2", "3", "2"], tokenizer), group(chat, ["hi", "2", "hi"], tokenizer)]
    scored = reward_groups(groups, reward_fn=reward, decode=tokenizer.decode, eos_id=None)
    assert scored[0].rewards == [1.5, 0.0, 1.5] and scored[1].rewards == [1.0, 0.0, 1.0]
    # a component is its sources' own: NaN on the answers of a source it does not score
    assert scored[0].components["math"] == [1.0, 0.0, 1.0] and all(map(math.isnan, scored[1].components["math"]))
    assert scored[0].components["exact"] == [1.0, 0.0, 1.0] == scored[1].components["exact"]
    stats = Scored.from_groups(scored, algo=cfg.algo).stats()
    assert stats["sources"]["arith"]["reward_mean"] == pytest.approx(1.0)
    assert stats["sources"]["chat"]["reward_mean"] == pytest.approx(2 / 3)
    assert stats["sources"]["arith"]["num_answers"] == 3 and stats["reward_mean"] == pytest.approx(5 / 6)
    assert stats["reward_math_mean"] == pytest.approx(2 / 3)  # over arith's answers only


def test_a_source_without_a_reward_is_one_line_naming_it(tmp_path):
    cfg = job(tmp_path, 'rollout.source_rewards={"arith": "math"}')
    with pytest.raises(ConfigError, match=r"rollout.source_rewards is invalid for data.train_files: its rows' "
                                          r"source 'chat' has no reward"):
        read_inputs(cfg, "", build_tokenizer())


@pytest.mark.parametrize("overrides, needle", [
    (['rollout.source_rewards={"arith": "nope"}'], "rollout.source_rewards['arith']='nope' is invalid: unknown"),
    (["rollout.source_rewards='[1]'"], "expected a JSON object of source -> rollout.rewards spec"),
    (['rollout.source_rewards={"arith": "model:/x"}'], "a reward model serves rollout.rewards only"),
])
def test_bad_source_rewards_are_one_line(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as info:
        check_sources(job(tmp_path, *overrides))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_source_rewards_replace_rollout_rewards_and_need_data_files(tmp_path):
    with pytest.raises(ConfigError, match="rollout.rewards='math' is invalid: rollout.source_rewards is set too"):
        job(tmp_path, "rollout.rewards=math").check()
    with pytest.raises(ConfigError, match="rollout.source_rewards=.* there are none"):
        load_config(None, [f"rollout.source_rewards={SPEC}"]).check()
