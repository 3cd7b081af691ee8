"""Tool calls (Qwen/Hermes `<tool_call>` JSON) parsed robustly, arithmetic evaluated safely, and the calculator
environment in the rollout pool's turn loop: calls parsed, results appended as observations, malformed calls
answered, the final answer scored."""

from __future__ import annotations

import pytest

from colocate.rl.tasks import Sample
from colocate.rollout.tools import Calculator, MalformedCall, ToolCall, evaluate, parse_tool_calls
from tests.unit.test_environments import EOS, make_pool

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}\n</tool_call>'


def test_well_formed_calls_are_parsed_in_order():
    two = CALL + ' and <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(two) == [ToolCall("calculator", {"expression": "12*(3+4)"}),
                                     ToolCall("calculator", {"expression": "1+1"})]  # arguments as a JSON string
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize("text, problem", [
    ('<tool_call>{"name": "calculator"', "the call is not closed with </tool_call>"),
    ("<tool_call>{name: calculator}</tool_call>", "the call is not JSON (Expecting property name enclosed in double "
                                                  "quotes at character 1)"),
    ('<tool_call>["calculator"]</tool_call>', 'the call must be a JSON object with a string "name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
])
def test_malformed_calls_say_what_is_wrong(text, problem):
    [call] = parse_tool_calls(text)
    assert isinstance(call, MalformedCall) and call.problem == problem


@pytest.mark.parametrize("expression, result", [("12*(3+4)", 84), ("7/2", 3.5), ("2**10 - -1", 1025), ("9//2", 4)])
def test_arithmetic(expression, result):
    assert evaluate(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "is not allowed: numbers and"),
    ("9**9**9", "an exponent above 64 is not allowed"),
    ("1/0", "division by zero"),
    ("1 +", "is not an arithmetic expression"),
    # model-written input must never escape as another error, nor cost the controller time or memory
    ("(10.0**64)**64", "a value of 2\\*\\*256 or more is not allowed"),
    ("(-8)**0.5", "the result is not a real number"),
    ("(99**64)**64", "a value of 2\\*\\*256 or more is not allowed"),
    ("((((9**64)**64)**64)**64)**64", "a value of 2\\*\\*256 or more is not allowed"),
    ("1e300*1e300", "a value of 2\\*\\*256 or more is not allowed"),
    ("1+" * 600 + "1", "longer than 1000 characters"),
    ("\x00", "is not an arithmetic expression"),
])
def test_what_is_not_arithmetic_is_refused(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


def test_the_calculator_in_the_turn_loop(monkeypatch):
    """Through the rollout pool with a scripted engine (the tiny models' vocabulary cannot write a tool call):
    a call's result, then a malformed call's error, then the final answer scored 1."""
    import tests.unit.test_environments as helpers
    from colocate.engine.requests import RequestResult

    # bytes as tokens (10 + byte; the EOS is 2)
    monkeypatch.setattr(helpers, "tokenize", lambda text: [10 + b for b in text.encode()])
    monkeypatch.setattr(helpers, "decode", lambda tokens: bytes(t - 10 for t in tokens).decode())
    pool = make_pool(Calculator, num_samples=1, max_tokens=2000, max_model_len=4096)
    pool.top_up([(Sample("What is 12*(3+4)?", "84"), [], [2000])])
    turns = [CALL, '<tool_call>{"name": 1}</tool_call>', "The answer is 84."]
    for turn in turns:
        [request] = pool.requests(0)
        tokens = helpers.tokenize(turn) + [EOS]
        pool.apply([request], [RequestResult(request.request_id, tokens, [-0.1] * len(tokens), "stop", 0)], 0)
    answer = pool.groups[0].answers[0]
    assert helpers.decode([t for t in answer.token_ids if t != EOS]) == (
        CALL + '<tool_response>\n{"result": 84}\n</tool_response>\n' + turns[1] +
        '<tool_response>\n{"error": "malformed tool call: the call must be a JSON object with a string \\"name\\""}'
        '\n</tool_response>\n' + turns[2])
    assert answer.turn_rewards == [0.0, 0.0, 1.0] and answer.finish_reason == "stop"
    assert answer.mask.count(0) == len(helpers.tokenize('<tool_response>\n{"result": 84}\n</tool_response>\n')) + \
        len(helpers.tokenize('<tool_response>\n{"error": "malformed tool call: the call must be a JSON object with a '
                             'string \\"name\\""}\n</tool_response>\n'))
