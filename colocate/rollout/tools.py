"""Tool calls in the chat template's tool format, and the calculator environment that answers them.

Qwen2.5/Qwen3 and Hermes-style templates have the model write each call as JSON between tags:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    </tool_call>

and put each result in the next user turn between `<tool_response>` tags. `parse_tool_calls` reads every call of
a turn's text, robustly: a call that is not closed, not JSON, not an object with a string "name" and an object
"arguments" (a JSON string of an object is accepted: some models write it so) comes back as a `MalformedCall`
saying what is wrong, never an exception. The environment answers a malformed call with an observation saying so,
so the model sees its mistake and the episode goes on.

    env = Calculator()                     # rollout.env=colocate.rollout.tools:Calculator
    env.reset(Sample("What is 12*(3+4)? Give the answer as a number.", "84"))
    env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>')
        -> ('<tool_response>\\n{"result": 84}\\n</tool_response>\\n', 0.0, False)
    env.step("The answer is 84.")           # no call: the final answer, scored
        -> ('', 1.0, True)

The observation is the bare `<tool_response>` block. A chat model needs its template's turn markers around it
(Qwen: `<|im_end|>\\n<|im_start|>user\\n` before, `<|im_end|>\\n<|im_start|>assistant\\n` after): pass them as
`before` and `after` from a factory of your own, e.g. `lambda: Calculator(before=..., after=...)`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass

from colocate.rl.rewards import answers_equal, final_answer
from colocate.rl.tasks import Sample

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedCall:
    text: str
    problem: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` block of `text`, in order, parsed or saying why not."""
    calls: list[ToolCall | MalformedCall] = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(MalformedCall(body, "the call is not closed with </tool_call>"))
            continue
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(MalformedCall(body, f"the call is not JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(MalformedCall(body, 'the call must be a JSON object with a string "name"'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(MalformedCall(body, '"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # 10**64 is plenty for arithmetic
MAX_BITS = 256  # every value stays below 2**256: model-written input must not cost the controller time or memory
MAX_LENGTH = 1000  # characters of an expression


def evaluate(expression: str) -> int | float:
    """Arithmetic only: numbers, + - * / // % **, parentheses, every value below 2**256 in magnitude and real.
    ValueError says what is not allowed; nothing else escapes, whatever the expression."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"an expression longer than {MAX_LENGTH} characters is not allowed")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a null byte
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None

    def bounded(number):
        if isinstance(number, complex):
            raise ValueError("the result is not a real number")
        if isinstance(number, float) and not math.isfinite(number) or abs(number) >= 2.0 ** MAX_BITS:
            raise ValueError(f"a value of 2**{MAX_BITS} or more is not allowed")
        return number

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"an exponent above {MAX_EXPONENT} is not allowed")
            if isinstance(node.op, ast.Pow) and abs(left) > 1 and right > 0 and \
                    right * math.log2(abs(left)) >= MAX_BITS:  # refused before it is computed
                raise ValueError(f"a value of 2**{MAX_BITS} or more is not allowed")
            return bounded(_OPERATORS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return bounded(_OPERATORS[type(node.op)](value(node.operand)))
        raise ValueError(f"{ast.unparse(node)!r} is not allowed: numbers and + - * / // % ** only")

    try:
        result = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except (ArithmeticError, TypeError, RecursionError) as e:  # overflow, a complex power, deep nesting
        raise ValueError(f"{type(e).__name__}: {e}") from None
    return int(result) if isinstance(result, float) and result.is_integer() else result


class Calculator:
    """A tool-using environment: each turn either calls `calculator` (its result is the observation) or gives
    the final answer, which ends the episode with reward 1 if it equals the sample's answer, else 0. A malformed
    or unknown call is answered with an error observation (and no reward)."""

    def __init__(self, *, before: str = "", after: str = "\n"):
        self.before, self.after = before, after

    def reset(self, sample: Sample) -> str:
        self.answer = sample.answer
        return sample.prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        calls = parse_tool_calls(action)
        if not calls:
            predicted = final_answer(action)
            return "", float(predicted is not None and answers_equal(predicted, self.answer)), True
        return self.before + "".join(self._respond(call) for call in calls) + self.after, 0.0, False

    def _respond(self, call: ToolCall | MalformedCall) -> str:
        if isinstance(call, MalformedCall):
            content = {"error": f"malformed tool call: {call.problem}"}
        elif call.name != "calculator":
            content = {"error": f"unknown tool {call.name!r}; the only tool is 'calculator'"}
        elif not isinstance(call.arguments.get("expression"), str):
            content = {"error": 'calculator takes {"expression": "<arithmetic>"}'}
        else:
            try:
                content = {"result": evaluate(call.arguments["expression"])}
            except ValueError as e:
                content = {"error": str(e)}
        return f"<tool_response>\n{json.dumps(content)}\n</tool_response>"
