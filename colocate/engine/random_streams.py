"""Carry a request's random stream across an abort, so a continued answer samples as if never interrupted.

A partial answer is continued as a new request: the prompt followed by the tokens it already has. Seeded as
the first request was, it would replay that request's first random draws. vLLM 0.32's V1 model runner (the one
the CPU runs; `v1/worker/gpu_model_runner.py`, `_update_states`) gives each seeded request its own
`torch.Generator`, seeded once from `SamplingParams.seed` when the request is first scheduled, and the sampler
draws one row of exponential noise from it per sampled token (`v1/sample/ops/topk_topp_sampler.py`,
`random_sample`). So, before the abort, each worker reads the generator's state; and the continuation's
generator is set to that state the moment the runner creates it, before its first sample: the runner's
request table (`model_runner.requests`, a dict it re-reads on every use) is swapped once for a dict that sets
an expected state on insertion.

vLLM's V2 model runner (CUDA, `v1/worker/gpu/sample/gumbel.py`) draws its noise from a hash of (seed, position)
instead of a generator: a continuation with the same seed continues the same stream with nothing to carry.
There `model_runner.requests` holds no generators and these functions carry nothing.

Hazard: under async scheduling the runner may have sampled one token more than the engine has reported when
the state is read; such a state is not returned (the continuation then samples from a fresh stream: still
correct, no longer identical to an uninterrupted run).
"""

from __future__ import annotations

import torch


class _RestoringRequests(dict):
    """The runner's request table, setting the expected generator state of a request as it is added."""

    def __init__(self, existing: dict):
        super().__init__(existing)
        self.expected: dict[str, bytes] = {}

    def __setitem__(self, req_id, state) -> None:
        saved = self.expected.pop(req_id, None)
        generator = getattr(state, "generator", None)
        if saved is not None and generator is not None:
            generator.set_state(torch.frombuffer(bytearray(saved), dtype=torch.uint8))
        super().__setitem__(req_id, state)


def read_states(runner, num_tokens: dict[str, int]) -> dict[str, bytes]:
    """Generator state of each request (by vLLM's internal id) whose runner has sampled exactly the
    `num_tokens` the engine reported for it."""
    states = {}
    for req_id, expected_tokens in num_tokens.items():
        state = runner.requests.get(req_id)
        generator = getattr(state, "generator", None)
        if generator is None or len(state.output_token_ids) != expected_tokens:
            continue
        states[req_id] = generator.get_state().numpy().tobytes()
    return states


def expect_states(runner, states: dict[str, bytes]) -> None:
    """Set these generator states (by vLLM's internal request id) when the runner adds those requests."""
    if not isinstance(runner.requests, _RestoringRequests):
        # Once per worker, while no request is being added (between engine steps).
        runner.requests = _RestoringRequests(runner.requests)
    runner.requests.expected.update(states)
