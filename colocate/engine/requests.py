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
"""

from __future__ import annotations

import time
from dataclasses import dataclass


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
    random_state: bytes | None = None
    """Where this answer's random stream stopped (engine.random_streams), for a continuation."""


@dataclass
class RequestResult:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    """stop / length as vLLM says; None: aborted when enough groups were complete."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache (their prefill was not computed)."""
    random_state: bytes | None = None

    def done(self, request: EngineRequest) -> bool:
        return self.finish_reason == "stop" or (self.finish_reason == "length" and request.final)


def run_pass(llm, requests: list[EngineRequest], sampling: dict, *, num_groups_wanted: int | None,
             eos_token_id: int | None) -> tuple[list[RequestResult], list[tuple[float, int]]]:
    """Run `requests` until each is finished, or until `num_groups_wanted` groups are complete (the rest are
    aborted). Returns the results in request order and the busy timeline: per engine step, (seconds since the
    start, sequences that produced a token in it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    by_id = {r.request_id: r for r in requests}
    results = {r.request_id: RequestResult(r.request_id, [], [], None, 0) for r in requests}
    internal_ids, expected_states = {}, {}
    # Rendered as LLM.generate renders them (vLLM 0.32: entrypoints/common/offline.py; a raw prompt passed to
    # add_request is deprecated there): LLM's own offline path forces FINAL_ONLY outputs, which would lose the
    # tokens of the requests this pass aborts.
    rendered = llm._preprocess_cmpl([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests])
    for r, prompt in zip(requests, rendered):
        params = SamplingParams(
            n=1, temperature=sampling["temperature"], top_p=sampling["top_p"], max_tokens=r.max_tokens,
            seed=r.seed, logprobs=0, detokenize=False, ignore_eos=sampling.get("ignore_eos", False),
            # ignore_eos (the long-tail benchmark's fixed lengths) must also skip the EOS stop token
            stop_token_ids=[eos_token_id] if eos_token_id is not None and not sampling.get("ignore_eos") else None,
            output_kind=RequestOutputKind.DELTA)
        internal_ids[r.request_id] = engine.add_request(r.request_id, prompt, params)
        if r.random_state is not None:
            expected_states[internal_ids[r.request_id]] = r.random_state
    if expected_states:  # before the first step schedules (and samples for) these requests
        llm.collective_rpc("colocate_expect_random_states", args=(expected_states,))

    groups_left = {}  # group -> its requests not yet done
    for r in requests:
        groups_left.setdefault(r.group, set()).add(r.request_id)
    num_complete, unfinished = 0, set(by_id)
    timeline, started = [], time.perf_counter()
    while unfinished and (num_groups_wanted is None or num_complete < num_groups_wanted):
        outputs = engine.step()
        timeline.append((time.perf_counter() - started, sum(1 for o in outputs if o.outputs[0].token_ids)))
        capped = []  # stopped at this step's share of their budget: they go on next pass, from where they are
        for out in outputs:
            result, completion = results[out.request_id], out.outputs[0]
            result.token_ids += completion.token_ids
            # logprobs=0: only the sampled token's logprob at each new position
            result.logprobs += [next(iter(lp.values())).logprob for lp in completion.logprobs or []]
            result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens or 0)
            if out.finished:
                result.finish_reason = completion.finish_reason
                unfinished.discard(out.request_id)
                if result.done(by_id[out.request_id]):
                    left = groups_left[by_id[out.request_id].group]
                    left.discard(out.request_id)
                    num_complete += not left
                else:
                    capped.append(result)
        if capped:
            # Hazard: the runner frees a finished request's state (and generator) at the next engine step, so
            # its random state is read now.
            _read_random_states(llm, capped, internal_ids)
    if unfinished:
        still_running = [results[i] for i in unfinished]
        _read_random_states(llm, still_running, internal_ids)
        engine.abort_request([r.request_id for r in still_running])
    return [results[r.request_id] for r in requests], timeline


def _read_random_states(llm, results: list[RequestResult], internal_ids: dict[str, str]) -> None:
    """Each request's random state, for its continuation. Every TP worker samples the same tokens with the same
    generator, so their states agree; the first worker's is kept."""
    num_tokens = {internal_ids[r.request_id]: len(r.token_ids) for r in results}
    states = llm.collective_rpc("colocate_read_random_states", args=(num_tokens,))
    assert all(s == states[0] for s in states[1:]), "TP workers' random streams diverged"
    for r in results:
        r.random_state = states[0].get(internal_ids[r.request_id])
