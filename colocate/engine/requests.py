"""One rollout pass of an engine, driven step by step: requests in, tokens out, stopped early when enough groups
are complete, the unfinished aborted with what they have so far.

`LLM.generate` runs every request to its end. Partial rollout and over-sampling need the engine loop itself
(vLLM's `LLMEngine.add_request / step / abort_request`, in process: `step()` runs the engine core
synchronously, so nothing is sampled between two calls): after each engine step the pass knows every
request's new tokens, how many sequences were decoding, and whether enough groups are complete to stop.

    results, timeline = run_pass(llm, requests, sampling, num_groups_wanted=4, eos_token_id=2)

A request is one answer's next segment. `final` says whether its `max_tokens` is the answer's whole remaining
budget (reaching it completes the answer) or only this step's share (partial rollout: the answer goes on next
step). A group is complete when every one of its answers is (stopped, or at its final length).

Random streams: every segment is seeded by `segment_seed(answer seed, tokens the answer already has)`. A
continuation is then a plain seeded request, decided by the answer alone: the same after a resume from a
checkpoint, the same on every TP worker, and the same whichever model runner vLLM picks. Nothing is read from
the runner: vLLM 0.32 runs its V1 runner on the CPU (a `torch.Generator` per request, `v1/worker/
gpu_model_runner.py`) and its V2 runner on CUDA by default (`config/vllm.py`, `use_v2_model_runner`; noise
hashed from the seed and position, `v1/worker/gpu/sample/gumbel.py`, and no `requests` table at all). The price:
a continued answer is not the uninterrupted one token for token (its later segments draw from other seeds),
only equal in distribution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from colocate.engine.pass_gate import PassGate

if TYPE_CHECKING:
    from colocate.engine.stream import PassStream


@dataclass
class EngineRequest:
    request_id: str
    group: int
    index: int
    """The answer's place in its group."""
    prompt_ids: list[int]
    """The prompt followed by the tokens the answer already has."""
    max_tokens: int
    final: bool
    seed: int
    """This segment's seed: `segment_seed(answer seed, tokens it already has)`."""
    num_turn_tokens: int = 0
    """Multi-turn: the tokens of the current turn already at the end of `prompt_ids` (a turn continued from an
    earlier pass), where rollout.turn_stop may have begun."""


@dataclass
class RequestResult:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    """stop / length as vLLM says; None: aborted when enough groups were complete."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache (their prefill was not computed)."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token: the pass's, and after a weight update inside the pass
    (engine/pass_gate.py) the new one. Empty from a source that does not say (the pool tags the pass's version)."""
    routing: object = None
    """algo.router_replay: uint16 [positions, layers, top_k], the experts each position of the prompt and answer
    (but the last sampled token) was routed to in the engine (engine/routing.py); None without it."""

    def done(self, request: EngineRequest) -> bool:
        return self.finish_reason == "stop" or (self.finish_reason == "length" and request.final)


def run_pass(llm, requests: list[EngineRequest], sampling: dict, *, num_groups_wanted: int | None,
             eos_token_id: int | None, lora_request=None, version: int = 0,
             gate: PassGate | None = None,
             stream: PassStream | None = None,
             routing=None) -> tuple[list[RequestResult], list[tuple[float, int]]]:
    """Run `requests` until each is finished, or until `num_groups_wanted` groups are complete (the rest are
    aborted). Returns the results in request order and the busy timeline: per engine step, (seconds since the
    start, sequences that produced a token in it). `lora_request`: the adapter every request runs with (a LoRA
    job's policy), or None. `version`: the policy the pass was planned under; `gate`: the engine's, through which
    a weight update enters the pass between two steps (engine/pass_gate.py), each token tagged with the version
    that sampled it. `stream` (rollout.stream, engine/stream.py): more requests are added as they are fed, each
    finished result leaves through it at once, and the pass returns only the rest (no `num_groups_wanted`).
    `routing` (algo.router_replay; not with a stream): request ids -> their captured routing, read once the
    pass has ended (EngineActor.take_routing)."""
    assert stream is None or routing is None, "a streamed pass's results leave before their routing is read"
    assert stream is None or num_groups_wanted is None, "a streamed pass runs its requests to their ends"
    gate = gate or PassGate()  # a pass of its own: nothing enters it
    with gate.running(version):
        if stream is not None:
            stream.open()
        try:
            results, timeline = _run_pass(llm, requests, sampling, num_groups_wanted=num_groups_wanted,
                                          eos_token_id=eos_token_id, lora_request=lora_request, gate=gate,
                                          stream=stream)
        finally:
            if stream is not None:
                stream.close()
    if routing is not None:
        rows = routing([r.request_id for r in results])
        for r in results:
            r.routing = rows.get(r.request_id)
    return results, timeline


def _run_pass(llm, requests: list[EngineRequest], sampling: dict, *, num_groups_wanted: int | None,
              eos_token_id: int | None, lora_request, gate: PassGate, stream: PassStream | None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    stop_ids = sampling.get("stop_ids") or []  # rollout.turn_stop's tokens: a request ends right after them
    by_id: dict[str, EngineRequest] = {}
    results: dict[str, RequestResult] = {}
    groups_left: dict[int, set[str]] = {}  # group -> its requests not yet done
    unfinished: set[str] = set()

    def add(added: list[EngineRequest]) -> None:
        """Into the engine, inside the gate's work. Rendered as LLM.generate renders them (vLLM 0.32: entrypoints/
        common/offline.py; a raw prompt passed to add_request is deprecated there): LLM's own offline path forces
        FINAL_ONLY outputs, which would lose the tokens of the requests this pass aborts. A streamed pass salts
        each prompt's prefix-cache hashes with the weights' version (vLLM 0.32 v1/core/kv_cache_utils.py hashes
        `cache_salt` into a request's first block, and the blocks after chain from it): a request fed after an
        update inside the pass never reads a prefix the old weights computed, while the pass goes on for good."""
        salt = {"cache_salt": f"v{gate.version}"} if stream is not None else {}
        rendered = llm._preprocess_cmpl([TokensPrompt(prompt_token_ids=r.prompt_ids, **salt) for r in added])
        for r, prompt in zip(added, rendered):
            params = SamplingParams(
                n=1, temperature=sampling["temperature"], top_p=sampling["top_p"], max_tokens=r.max_tokens,
                seed=r.seed, logprobs=0, detokenize=False, ignore_eos=sampling.get("ignore_eos", False),
                # ignore_eos (the long-tail benchmark's fixed lengths) must also skip the EOS stop token
                stop_token_ids=[eos_token_id] if eos_token_id is not None and not sampling.get("ignore_eos")
                else None, output_kind=RequestOutputKind.DELTA)
            engine.add_request(r.request_id, prompt, params, lora_request=lora_request)
            by_id[r.request_id], results[r.request_id] = r, RequestResult(r.request_id, [], [], None, 0)
            if stream is None:  # a streamed pass counts no groups (it runs its requests to their ends)
                groups_left.setdefault(r.group, set()).add(r.request_id)
            unfinished.add(r.request_id)
        gate.added = True

    with gate.work():
        add(requests)
    num_complete = 0
    timeline, started = [], time.perf_counter()
    while (num_groups_wanted is None or num_complete < num_groups_wanted) and not gate.ending:
        with gate.work():  # an update waits for this step and its aborts; the next step is the new weights'
            if stream is not None and (fed := stream.take_inbox()):
                add(fed)
            if not unfinished and (stream is None or stream.close_if_idle()):
                break
            if not unfinished:
                continue  # fed as the pass was about to end: added at the next look
            outputs, version = engine.step(), gate.version
            gate.steps, gate.stepped_at = gate.steps + 1, time.monotonic()
            request_steps, tokens = _decoded(outputs)
            gate.request_steps, gate.tokens = gate.request_steps + request_steps, gate.tokens + tokens
            busy = (time.perf_counter() - started, request_steps)  # the sequences that produced a token
            if stream is not None:  # out with the step's results: a streamed pass may outlive many steps
                stream.stepped(busy, request_steps, tokens)
            else:
                timeline.append(busy)
            for out in outputs:
                result, completion = results[out.request_id], out.outputs[0]
                result.token_ids += completion.token_ids
                # logprobs=0: only the sampled token's logprob at each new position
                result.logprobs += [next(iter(lp.values())).logprob for lp in completion.logprobs or []]
                result.versions += [version] * len(completion.token_ids)
                result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens or 0)
                stopped = bool(stop_ids) and _cut_at_stop(
                    result, len(completion.token_ids), stop_ids,
                    turn_before=_turn_tail(by_id[out.request_id], len(stop_ids)))
                if stopped and not out.finished:
                    engine.abort_request([out.request_id])  # what it decodes from here on is not the turn's
                if out.finished or stopped:
                    result.finish_reason = "stop" if stopped else completion.finish_reason
                    unfinished.discard(out.request_id)
                    if stream is not None:  # out at once, and not in the pass's return; a streamed pass may run
                        # for many steps, so it keeps nothing of a finished request (its prompt least of all)
                        stream.finished(results.pop(out.request_id))
                        del by_id[out.request_id]
                    elif result.done(by_id[out.request_id]):
                        left = groups_left[by_id[out.request_id].group]
                        left.discard(out.request_id)
                        num_complete += not left
    with gate.work():
        if unfinished:  # stopped mid-segment: they go on next pass, from where they are, under their next seed
            engine.abort_request(sorted(unfinished))
        if gate.updated_in_pass:
            # rollout.update_in_pass=keep: the prefix cache holds blocks the old weights computed, which could not
            # be reset while this pass's requests held them; now none does (engine/pass_gate.py)
            llm.reset_prefix_cache()
    if stream is not None:  # what did not leave through the stream: the aborted, in the order added
        return list(results.values()), timeline
    return [results[r.request_id] for r in requests], timeline


def _decoded(outputs) -> tuple[int, int]:
    """An engine step's requests that produced tokens, and those tokens (more than one a request where
    speculative decoding's drafts were accepted)."""
    counts = [len(o.outputs[0].token_ids) for o in outputs if o.outputs[0].token_ids]
    return len(counts), sum(counts)


def _turn_tail(request: EngineRequest, num_stop: int) -> list[int]:
    """The turn's tokens from earlier passes that a stop text completed in this one may begin in (at most one
    fewer than the stop's), never the observation or the prompt before the turn."""
    return request.prompt_ids[len(request.prompt_ids) - min(request.num_turn_tokens, num_stop - 1):]


def _cut_at_stop(result: RequestResult, num_new: int, stop_ids: list[int], *, turn_before: list[int] = ()) -> bool:
    """Whether the tokens just added complete `stop_ids`, which may have begun in `turn_before` (the turn's tokens
    from earlier passes); if so, cut the result right after them (a step may have added more than one token) and
    say it ended there."""
    tokens, n, offset = [*turn_before, *result.token_ids], len(stop_ids), len(turn_before)
    for end in range(max(n, len(tokens) - num_new + 1), len(tokens) + 1):
        if tokens[end - n:end] == stop_ids:
            cut = end - offset
            del result.token_ids[cut:], result.logprobs[cut:], result.versions[cut:]
            return True
    return False


def segment_seed(answer_seed: int, num_tokens: int) -> int:
    """The seed of an answer's segment that starts after its first `num_tokens` tokens: the answer's own seed
    for its first segment, a splitmix64 mix of (seed, position) for each continuation (nearby seeds and
    positions give unrelated streams), kept below 2**31 like the pool's answer seeds."""
    if num_tokens == 0:
        return answer_seed
    x = (answer_seed * 0x9E3779B97F4A7C15 + num_tokens) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) % 2**31
