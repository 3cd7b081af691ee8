"""A vLLM logits processor that makes the tiny-chat model write a scripted tool-using episode, for the calculator
environment's e2e test: a random model never writes `<tool_call>{"name": ...}` by chance, so the test decides the
tokens and checks what the rest of the stack (the turn loop, the environment, the masks, the trainer) does with
them. It is loaded by vLLM's own extension point (`engine.extra_args={"logits_processors": [...]}`), in the
engine's workers; every other token of the episode (prompts, observations) is the product's.

The turn is read from the request's prompt (the episode so far): the number of `<tool_response>` blocks in it.
    turn 0: a call of the expression the task's prompt asks for ("12+34=" -> "12+34"), then text a model might
            go on with (rollout.turn_stop=</tool_call> must end the turn before it)
    turn 1: a malformed call (not JSON)
    turn 2: "answer: " and the result of the first call's response
Each turn ends with EOS. Setting every other logit to -inf makes the scripted token the only one sampled (its
logprob 0).
"""

from __future__ import annotations

import json
import re

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.interface import MoveDirectionality

from colocate.models.sources import CHAT_CHARACTERS, SPECIAL_TOKENS

VOCAB = SPECIAL_TOKENS + list(CHAT_CHARACTERS)
EOS = VOCAB.index("<eos>")
MALFORMED = "<tool_call>{name: calculator}</tool_call>"
AFTER_THE_CALL = "<tool_response>made up"


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def script(context: str) -> str:
    """The turn the model is made to write after `context` (the task's prompt and the episode's turns so far)."""
    num_responses = context.count("<tool_response>")
    if num_responses == 0:
        return call(context.split("=")[0]) + AFTER_THE_CALL
    if num_responses == 1:
        return MALFORMED
    return "answer: " + str(json.loads(re.search(r"<tool_response>\n(.*?)\n", context).group(1))["result"])


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i >= len(SPECIAL_TOKENS))


class ScriptedToolCalls(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, tuple[str, list[int]]] = {}  # batch index -> (the turn's script, its output so far)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, _params, prompt_ids, output_ids in batch_update.added:
            self.rows[index] = (script(decode(prompt_ids or [])), output_ids)  # output_ids: a live reference
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (text, output_ids) in self.rows.items():
            position = len(output_ids)
            token = VOCAB.index(text[position]) if position < len(text) else EOS
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits
