"""rollout.turn_stop: the engine pass ends a turn right after the stop text's tokens (engine/requests.py), with
vLLM's offline engine loop faked at its boundary (add_request / step / abort_request)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from colocate.config import load_config
from colocate.engine.requests import EngineRequest, RequestResult, _cut_at_stop, run_pass
from colocate.errors import ConfigError

STOP = [7, 8]


class FakeEngineLoop:
    """Each request decodes its script, `per_step` tokens a step, then finishes ("stop", as at an EOS)."""

    def __init__(self, scripts: dict[str, list[int]], per_step: int = 1):
        self.scripts, self.per_step, self.live, self.aborted = scripts, per_step, {}, []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.live[request_id] = list(self.scripts[request_id])

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for r in request_ids:
            self.live.pop(r)

    def step(self):
        outputs = []
        for request_id, left in list(self.live.items()):
            new, self.live[request_id] = left[:self.per_step], left[self.per_step:]
            finished = not self.live[request_id]
            if finished:
                del self.live[request_id]
            completion = SimpleNamespace(token_ids=new, logprobs=[{t: SimpleNamespace(logprob=-0.1 * t)} for t in new],
                                         finish_reason="stop" if finished else None)
            outputs.append(SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished,
                                           num_cached_tokens=0))
        return outputs


def run(scripts, stop_ids, per_step=1):
    loop = FakeEngineLoop(scripts, per_step)
    llm = SimpleNamespace(llm_engine=loop, _preprocess_cmpl=lambda prompts: prompts)
    requests = [EngineRequest(r, group=i, index=0, prompt_ids=[1], max_tokens=20, final=True, seed=0)
                for i, r in enumerate(scripts)]
    sampling = {"temperature": 1.0, "top_p": 1.0, "stop_ids": stop_ids}
    results, _ = run_pass(llm, requests, sampling, num_groups_wanted=None, eos_token_id=2)
    return results, loop.aborted


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_turn_ends_right_after_the_stop_tokens(per_step):
    results, aborted = run({"a": [5, 7, 8, 9, 9, 2], "b": [5, 6, 2], "c": [7, 5, 7, 8]}, STOP, per_step)
    assert [r.token_ids for r in results] == [[5, 7, 8], [5, 6, 2], [7, 5, 7, 8]]
    assert [r.finish_reason for r in results] == ["stop"] * 3
    assert results[0].logprobs == pytest.approx([-0.5, -0.7, -0.8])  # cut with their tokens
    assert aborted == ["a"]  # "c" ended on its own as its stop was written; "b" never wrote it


def test_without_a_stop_text_turns_end_at_eos():
    results, aborted = run({"a": [5, 7, 8, 9, 2]}, [])
    assert results[0].token_ids == [5, 7, 8, 9, 2] and aborted == []


def test_cut_at_stop_looks_only_where_new_tokens_can_complete_it():
    result = RequestResult("a", [7, 8, 5, 6], [0.0] * 4, None, 0)
    assert not _cut_at_stop(result, 1, STOP)  # the old match was seen when it was new
    result = RequestResult("a", [5, 7, 8, 6], [0.0] * 4, None, 0)
    assert _cut_at_stop(result, 2, STOP) and result.token_ids == [5, 7, 8]


def test_turn_stop_needs_an_environment():
    with pytest.raises(ConfigError, match=r"^rollout.turn_stop='</tool_call>' is invalid: ends a turn of "):
        load_config(None, ["rollout.turn_stop=</tool_call>"])
    assert load_config(None, ["rollout.env=calculator", "rollout.turn_stop=</tool_call>"]).rollout.turn_stop


def test_a_stop_begun_in_an_earlier_pass_of_the_turn_is_completed_here():
    """A turn cut mid-way by a pass's end continues in the next; its stop may straddle the two. Only the turn's own
    tokens count: an observation (or prompt) ending like the stop's beginning does not."""
    loop = FakeEngineLoop({"a": [8, 9, 2], "b": [8, 9, 2]})
    llm = SimpleNamespace(llm_engine=loop, _preprocess_cmpl=lambda prompts: prompts)
    requests = [EngineRequest("a", group=0, index=0, prompt_ids=[1, 5, 7], max_tokens=20, final=True, seed=0,
                              num_turn_tokens=2),  # [5, 7] were sampled in this turn, in the last pass
                EngineRequest("b", group=1, index=0, prompt_ids=[1, 5, 7], max_tokens=20, final=True, seed=0,
                              num_turn_tokens=0)]  # the turn starts here: the 7 is the observation's
    results, _ = run_pass(llm, requests, {"temperature": 1.0, "top_p": 1.0, "stop_ids": STOP},
                          num_groups_wanted=None, eos_token_id=2)
    assert [r.token_ids for r in results] == [[8], [8, 9, 2]]
    assert loop.aborted == ["a"]


def test_a_stop_the_tokenizer_cannot_write_is_refused():
    from colocate.job.checks import check_turn_stop
    from colocate.models.sources import CHAT_CHARACTERS, SPECIAL_TOKENS, VOCAB, build_tokenizer

    check_turn_stop("</tool_call>", build_tokenizer(SPECIAL_TOKENS + list(CHAT_CHARACTERS)))  # tiny-chat's
    with pytest.raises(ConfigError, match=r"^rollout.turn_stop='</tool_call>' is invalid: the model's tokenizer "
                                          r"cannot write it \(its 12 tokens read back as '<unk><unk>tool"):
        check_turn_stop("</tool_call>", build_tokenizer(VOCAB))  # the toy vocabulary has no <, / or _
