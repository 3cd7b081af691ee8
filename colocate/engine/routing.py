"""Routing capture for router replay (algo.router_replay, R3): the experts every token of a request was routed to in
the engine, per layer, for the trainer to replay in its forward pass.

    capture = RoutingCapture(worker.model_runner)          # in the worker extension, TP rank 0
    ... the engine steps ...
    rows = capture.take(["g3-a1", ...])                     # {request id: uint16 [positions, layers, top_k]}

Where the ids come from: vLLM's own hook. Every MoE layer's router (`BaseRouter.select_experts`,
`model_executor/layers/fused_moe/router/base_router.py`) hands its logical `topk_ids` to a `capture_fn` before the
EPLB mapping, and vLLM's `bind_routed_experts_capturer` (`fused_moe/routed_experts_capturer.py`) binds
`capture(layer_id, topk_ids)` of any object to every router of a model. vLLM 0.32's own consumer of that hook, the
aux-output connector behind `enable_return_routed_experts`, runs only in its V2 model runner, which needs Triton
and refuses the CPU; this one reads the V1 runner (the CPU's) and so runs in CI.

Where each row goes: a routing cache laid out like the KV cache, one row per KV slot (block id x block size +
offset), written in the step that writes the slot's keys and values. A prefix-cache hit then reads the routing of
the forward that computed the cached keys, as the engine itself did, and a recomputed (preempted) request writes
its rows again. It costs top_k x layers x 2 bytes a slot: 16 B for bench-moe against its 4 KiB of KV.

Hazards:
- The step's rows sit in `rows` in the order the V1 runner flattened the batch (`input_batch.req_ids`, each
  request's scheduled tokens from its computed count: `_prepare_inputs`); they are read after `execute_model`
  returns, before the next step's `_update_states` reorders anything.
- A finished request's blocks are freed by the scheduler in the step it finishes and may be reused by the next
  step: its rows are read at the start of that next step (its id is in `finished_req_ids`, and the runner still
  holds its block table), or by `take` when no step came after.
- vLLM adds a random suffix to every request id (`v1/engine/input_processor.py`, `f"{id}-{random_uuid():.8}"`);
  `take` is asked by the caller's id.
- The write is a device op on the captured ids (`rows[:n, layer] = ids`, as vLLM's own capturer), so a CUDA graph
  replays it; the scatter into the slot cache runs after the step, outside any graph. Untested on CUDA (no GPU
  here); there, vLLM's V2 runner is the default and this capture needs VLLM_USE_V2_MODEL_RUNNER=0.
"""

from __future__ import annotations

import numpy as np
import torch

ROUTING_DTYPE = np.uint16  # expert ids below 65,536


def external_id(request_id: str) -> str:
    """The caller's request id, without the suffix vLLM's input processor added."""
    head, dash, tail = request_id.rpartition("-")
    return head if dash and len(tail) == 8 else request_id


class RoutingCapture:
    def __init__(self, runner) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        model_config = runner.vllm_config.model_config
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.top_k = model_config.get_num_experts_per_tok()
        assert model_config.get_num_experts() > 0 and self.top_k > 0, "router replay needs a MoE model"
        self.runner = runner
        device = runner.device
        max_tokens = runner.scheduler_config.max_num_batched_tokens
        self.rows = torch.full((max_tokens, self.num_layers, self.top_k), -1, dtype=torch.int32, device=device)
        self.block_size = runner.cache_config.block_size
        num_slots = runner.kv_cache_config.num_blocks * self.block_size
        self.cache = torch.zeros((num_slots, self.num_layers, self.top_k), dtype=torch.int16, device=device)
        self.computed: dict[str, int] = {}  # per live request: positions its blocks hold rows for
        self.finished: dict[str, np.ndarray] = {}  # read when the request left the runner, until taken
        self.taken: set[str] = set()  # read by take() while still in the runner: not read again when it leaves
        self.num_dropped = 0  # rows nobody took before the next take (a caller that lost a request)
        bind_routed_experts_capturer(runner.model, self)
        step = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self._leaving(scheduler_output.finished_req_ids)
            out = step(scheduler_output, *args, **kwargs)
            self._store(scheduler_output)
            return out

        runner.execute_model = execute_model

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's router hook: this layer's expert ids for every token of the step."""
        self.rows[:topk_ids.shape[0], layer_id] = topk_ids

    def _slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        return np.asarray(block_ids, dtype=np.int64)[positions // self.block_size] * self.block_size \
            + positions % self.block_size

    def _store(self, scheduler_output) -> None:
        """The step's rows into the slots of the positions it computed."""
        total = scheduler_output.total_num_scheduled_tokens
        if not total:
            return
        batch, slots, offset = self.runner.input_batch, [], 0
        for index, req_id in enumerate(batch.req_ids):
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            start = int(batch.num_computed_tokens_cpu[index])
            slots.append(self._slots(self.runner.requests[req_id].block_ids[0], start, start + n))
            self.computed[req_id] = start + n
            offset += n
        assert offset == total, f"the runner's batch holds {offset} tokens, the scheduler's {total}"
        index = torch.from_numpy(np.concatenate(slots)).to(self.cache.device)
        self.cache[index] = self.rows[:total].to(torch.int16)

    def _read(self, req_id: str) -> np.ndarray:
        n = self.computed.get(req_id, 0)
        index = torch.from_numpy(self._slots(self.runner.requests[req_id].block_ids[0], 0, n))
        return self.cache[index.to(self.cache.device)].cpu().numpy().view(np.uint16).astype(ROUTING_DTYPE)

    def _leaving(self, finished_ids) -> None:
        for req_id in finished_ids:
            if req_id in self.runner.requests and req_id not in self.taken:
                self.finished[req_id] = self._read(req_id)
            self.taken.discard(req_id)
            self.computed.pop(req_id, None)

    def take(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """Each asked request's rows, positions 0.. of its prompt and answer that the engine computed (the last
        sampled token never is). Rows of requests not asked for are dropped: a pass takes all of its own."""
        wanted, out = set(request_ids), {}
        for req_id, rows in self.finished.items():
            if external_id(req_id) in wanted:
                out[external_id(req_id)] = rows
            else:
                self.num_dropped += 1
        self.finished.clear()
        for req_id in self.runner.requests:
            if external_id(req_id) in wanted and external_id(req_id) not in out:
                out[external_id(req_id)] = self._read(req_id)
                self.taken.add(req_id)
        return out
