"""The calculator environment on a real engine: the tiny-chat model (every printable character) is made to write a
scripted episode by a vLLM logits processor (tests/e2e/scripted_tool_calls.py: a random model never writes a tool
call by chance), and everything else is the product's: the turn loop, the environment's parsing and answers, the
observations appended as tokens, the masks and the training. Turn 0 calls the calculator on the task's sum and
would go on writing a made-up response, but rollout.turn_stop=</tool_call> ends the turn with the call; turn 1
makes a malformed call; turn 2 answers with the first call's result, which is right: reward 1."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import launch

pytestmark = pytest.mark.e2e

PROCESSOR = "tests.e2e.scripted_tool_calls:ScriptedToolCalls"


def test_calls_are_parsed_answered_and_appended_and_a_malformed_call_is_answered(tmp_path):
    result = launch(tmp_path, "model.preset=tiny-chat", "rollout.env=calculator", "rollout.task=add",
                    "rollout.max_turns=4", "rollout.turn_stop=</tool_call>", "rollout.max_tokens=448",
                    "engine.max_model_len=512",
                    f"engine.extra_args='{json.dumps({'logits_processors': [PROCESSOR]})}'",
                    "rollout.num_prompts=2", "rollout.num_samples=2", "algo.num_steps=1", "logging.progress=false",
                    "checkpoint.at_end=false", "eval.at_end=false",
                    # the turns are the driver's: one slot (a trainer rank, a TP=1 engine), whatever the layout
                    "placement.num_slots=1", "engine.tp=1")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in records if "event" not in r]
    rollout = step["rollout"]
    assert rollout["turns_per_episode"] == 3.0 and rollout["most_turns"] == 3 and rollout["num_env_dropped"] == 0
    assert step["reward_mean"] == 1.0  # every episode's final answer is the calculator's result
    assert step["num_trained_tokens"] == step["num_response_tokens"] - rollout["num_observation_tokens"]
    episode = step["sample"]["response"]
    prompt_sum = episode.split('"expression": "')[1].split('"')[0]
    first, second = (int(x) for x in prompt_sum.split("+"))
    assert episode == (
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{prompt_sum}"}}}}</tool_call>'
        f'<tool_response>\n{{"result": {first + second}}}\n</tool_response>\n'
        "<tool_call>{name: calculator}</tool_call>"
        '<tool_response>\n{"error": "malformed tool call: '
    ) + episode.split('malformed tool call: ')[1].split('"}')[0] + (
        f'"}}\n</tool_response>\nanswer: {first + second}')
