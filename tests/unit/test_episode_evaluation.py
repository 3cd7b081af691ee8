"""A multi-turn job's evaluation plays whole episodes with its environment (rollout/evaluation.py, EpisodeEvaluator):
the real Passes, pool and copy_turns environment, the engine faked at its actor boundary (run_pass) by one that
copies the digits it was last shown, right or wrong on the last turn. An episode is correct when its last turn's
reward is 1; its reward is the turns' sum, as in training."""

from __future__ import annotations

import pytest
import ray

from colocate.config import load_config
from colocate.engine.requests import RequestResult
from colocate.models.sources import build_tokenizer
from colocate.rollout.evaluation import EpisodeEvaluator, make_evaluator
from colocate.rl.tasks import make_task
from tests.unit.test_switching_order import FakeActor

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id


class CopyingEngine(FakeActor):
    """Answers each turn with the digits before the last "=" of its prompt, and EOS; on the second turn it writes
    them reversed when `wrong_last`."""

    wrong_last = False

    def do_run_pass(self, requests, sampling, num_groups_wanted, version=0):
        assert sampling["temperature"] == 0.0  # greedy: eval.temperature=0
        results = []
        for r in requests:
            text = TOKENIZER.decode(r.prompt_ids, skip_special_tokens=True)
            shown = text[-4:-1]  # the three digits before the prompt's last "="
            if self.wrong_last and text.count("=") == 2:
                shown = shown[::-1]
            tokens = TOKENIZER(shown, add_special_tokens=False).input_ids + [EOS]
            results.append(RequestResult(r.request_id, tokens, [-0.1] * len(tokens), "stop", 0))
        self.record("run_pass", len(requests))
        return {"results": results, "timeline": [(0.0, len(requests))], "seconds": 0.0}


@pytest.mark.parametrize("wrong_last, pass_at_1, reward_mean", [(False, 1.0, 2.0), (True, 0.0, None)])
def test_episodes_are_played_to_their_end_and_judged_by_their_last_turn(monkeypatch, wrong_last, pass_at_1,
                                                                        reward_mean):
    monkeypatch.setattr(ray, "get", lambda refs: [r.value for r in refs] if isinstance(refs, list) else refs.value)
    cfg = load_config("configs/default.yaml", ["rollout.env=copy_turns", "rollout.max_turns=2",
                                               "rollout.max_turn_tokens=3", "rollout.max_tokens=12",
                                               "eval.at_end=true", "eval.max_prompts=5", "rollout.env_workers=2"])
    log: list = []
    engine = CopyingEngine("engine 0", log, {})
    engine.wrong_last = wrong_last
    evaluator = make_evaluator(cfg, [engine], TOKENIZER, None, make_task("copy", length=3))
    assert isinstance(evaluator, EpisodeEvaluator)
    result = evaluator.run()
    assert result["pass_at_1"] == pass_at_1
    if reward_mean is None:  # right on the first turn, reversed on the last: part of its characters match
        assert 1.0 <= result["reward_mean"] < 2.0
    else:
        assert result["reward_mean"] == pytest.approx(reward_mean)
    assert result["num_prompts"] == 5 and result["num_samples"] == 1 and result["turns_per_episode"] == 2.0
    assert result["num_observation_tokens"] == 5 * 4  # "ddd=" between the turns
    first = evaluator.last_answers[0]
    prompt_digits, shown = first["prompt"][:-1], first["responses"][0][3:6]
    assert first["responses"][0] == prompt_digits + shown + "=" + (shown[::-1] if wrong_last else shown)
    assert first["turn_rewards"][0][0] == 1.0
    again = evaluator.run()  # the same prompts, played the same way: evaluations compare
    assert again["pass_at_1"] == result["pass_at_1"] and evaluator.last_answers[0] == first
