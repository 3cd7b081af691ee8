"""EngineActor: one vLLM engine (TP workers) inside a Ray actor. Its end of the weight sync is sync/engine_end.py's
(`EngineEnd` here, `WorkerEnd` in each worker), which its sync methods forward to.

The actor runs vLLM in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); vLLM's own executor starts the TP workers
(processes on the CPU, Ray workers in the slots' bundles on GPU). At TP=1 the one worker runs in the actor itself,
on both devices. Everything the controller needs from the workers goes through `collective_rpc` to
`ColocateWorkerExtension`.

    engine = EngineActor.options(...).remote(engine_cfg, model_path, device="cpu")
    ray.get(engine.start.remote())                       # raises EngineStartError with vLLM's reason
    results = ray.get(engine.generate.remote(prompts, sampling))
"""

from __future__ import annotations

import os
import re
import shutil
import time

import ray

from colocate.config import engine_extra_args
from colocate.engine.pass_gate import PassGate
from colocate.engine.stream import PassStream
from colocate.errors import EngineStartError

EXTENSION = "colocate.engine.extension.ColocateWorkerExtension"
CONTROL = "control"
"""The concurrency group (one thread) of the calls a weight update makes while a pass may be in flight in the
actor's default thread (rollout.update_in_pass): pause_pass, the sync's, memory, resume_pass. Their exclusion
from the pass is the engine's PassGate, not Ray's one call at a time. Create the actor with
ray.remote(concurrency_groups=CONCURRENCY_GROUPS)."""
PROBE = "probe"
"""The watchdog's probes (pid, worker_pids, worker_deaths), which read this actor's Python state alone: answered
at once, whatever the other two threads are doing (a pass parked for an update that failed would otherwise hold
them until the job's close)."""
STREAM = "stream"
"""A streamed rollout's feed and drain (rollout.stream, engine/stream.py): they touch the stream's lists alone, so
they go on while the pass runs or is parked for an update."""
CONCURRENCY_GROUPS = {CONTROL: 1, PROBE: 1, STREAM: 1}
CPU_PREFILL_TOKENS = 4096  # a CPU engine step's token budget per TP worker, vLLM 0.32's CPU default (arg_utils.py)


def engine_env(cfg, device: str, placement_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the engine actor; its TP worker processes inherit it. `placement_env`: the engine's own
    slots, and on CUDA the bundles vLLM's Ray executor must use (placement.engine_placement)."""
    env = {**(placement_env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false"}
    if cfg.batch_invariant:
        # read at import and at model runner start (vllm/envs.py, model_executor/determinism/batch_invariant.py
        # init_batch_invariance): the aten overrides, cuBLAS workspace and NCCL pins; the placement refuses it
        # where vLLM has no such kernels (job/placement.py)
        env["VLLM_BATCH_INVARIANT"] = "1"
    if device == "cpu":
        # 2-core machines: bind nothing (vLLM's auto binding wants a NUMA layout) and one OMP thread per worker.
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
        if cfg.enforce_eager == "true":
            # Eager means eager here: vLLM still wraps three small ops in torch.compile (vLLM 0.32: the TP vocab
            # mask, vocab_parallel_embedding.py; the sampler's random draw, topk_topp_sampler.py; the logprob
            # rank, logprobs.py), and each process traces and compiles them at its first step: measured about
            # 3 CPU-s per TP worker with inductor's disk cache warm, 13 s cold. Dynamo reads this at import.
            env["TORCH_COMPILE_DISABLE"] = "1"
    return env


def _prompt_logprobs(output) -> list[float]:
    """Each prompt token's logprob after the first (vLLM gives None for the first), by the token's own id: with
    prompt_logprobs=0 the entry holds the prompt token, and at most the top token beside it."""
    ids = output.prompt_token_ids
    return [entry[ids[i]].logprob for i, entry in enumerate(output.prompt_logprobs) if i > 0]


def head_dtype_override(hf_overrides: dict | None) -> dict:
    """engine.fp32_lm_head as vLLM 0.32 takes it: hf_overrides {"head_dtype": "float32"} (config/model.py
    `ModelConfig.head_dtype`). Its LogitsProcessor then casts the model-dtype hidden states and lm_head weight to
    fp32 and multiplies them there (model_executor/layers/logits_processor.py `_apply_head`; on CUDA one GEMM with
    fp32 output, torch.mm(out_dtype=...), elsewhere two casts and F.linear): the logits are never rounded to bf16,
    and the weight, the sleep and the sync stay in the engine's dtype. Merged into engine.extra_args' own."""
    return {**(hf_overrides or {}), "head_dtype": "float32"}


def without_rotary_kernel(compilation_config: dict | None) -> dict:
    """engine.native_rotary: vLLM's RotaryEmbedding is a CustomOp (model_executor/layers/rotary_embedding/base.py);
    "-rotary_embedding" in compilation_config.custom_ops turns its kernel off, and CustomOp dispatches to
    forward_native, plain torch (x1 cos - x2 sin, x2 cos + x1 sin from the fp32 cos/sin cache), the arithmetic of
    transformers' apply_rotary_pos_emb. vLLM's CPU kernel gives 16% of rotated q/k elements other bits
    (scripts/probe_consistency_layers.py). Merged into engine.extra_args' own compilation_config."""
    config = dict(compilation_config or {})
    config["custom_ops"] = [*config.get("custom_ops", []), "-rotary_embedding"]
    return config


def speculative_config(rollout) -> dict | None:
    """vLLM's speculative_config for rollout.speculative: ngram prompt lookup proposes rollout.speculative_tokens
    drafts a step from the longest match (4 tokens down to 2) of the request's last tokens in its own context."""
    if not rollout.speculative:
        return None
    return {"method": rollout.speculative, "num_speculative_tokens": rollout.speculative_tokens,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2}


class EngineActor:
    def __init__(self, cfg, model_path: str, *, device: str, sleep_backend: str, eos_token_id: int | None,
                 placement_env: dict[str, str] | None = None, speculative: dict | None = None,
                 update_in_pass: bool = False, capture_routing: bool = False):
        """`speculative`: vLLM's speculative_config for rollout.speculative (speculative_config()), or None.
        `update_in_pass`: weight updates enter this engine's passes (rollout.update_in_pass). `capture_routing`
        (algo.router_replay): every result carries the experts its tokens were routed to (engine/routing.py)."""
        self.cfg = cfg
        self.capture_routing = capture_routing
        self.speculative = speculative
        self.update_in_pass = update_in_pass
        self.placement_env = placement_env or {}
        self.model_path = model_path
        self.device = device
        self.sleep_backend = sleep_backend
        self.eos_token_id = eos_token_id
        self.llm = None
        self._prepared = False
        self._rpc_dir: str | None = None  # vLLM's IPC sockets (prepare)
        self.sync_end = None  # the engine's end of every sync (sync/engine_end.py EngineEnd), made by start()
        self._asleep: set[str] = set()  # the tags still asleep: nothing may generate before both woke
        self._deaths: list[tuple[int, int, int | None]] = []  # worker exits, in order (_watch_workers)
        self._adapter = None  # a LoRA job: the LoRARequest every generation carries (engine/lora.py)
        self._adapter_shapes: dict[str, tuple[int, ...]] = {}  # and the trainer's adapter tensors it holds
        self._gate = PassGate()  # a weight update inside a pass (rollout.update_in_pass)
        self._stream = PassStream()  # rollout.stream: requests fed into the pass in flight, results out as they end
        self._sleep_level = 0  # of the last sleep: a level-2 wake discarded the adapter's buffers (wake)
        self._worker_entries: set[str] = set()  # vLLM's /dev/shm entries its TP workers map (start), for shutdown

    # ------------------------------------------------------------------------------------------------ life

    def prepare(self) -> None:
        """Everything before the engine itself: the environment and vLLM's import (seconds of CPU), which the
        runtime runs while the trainers load. Importing vLLM touches no device memory (it creates no CUDA
        context: its workers could not be forked otherwise), so the memory order of the start is kept: the
        engine allocates in start(), after the trainers. Idempotent."""
        if self._prepared:
            return
        os.environ.update(engine_env(self.cfg, self.device, self.placement_env))
        # Owner-only files for everything vLLM creates from here (its TP workers inherit the umask): its ZMQ
        # IPC sockets in $VLLM_RPC_BASE_PATH (/tmp: vllm/utils/network_utils.py get_open_zmq_ipc_path) are
        # bound with the umask's mode, 0755 under the usual 022 and 0775 under 002, where group members could
        # connect; 0700 with this. Its /dev/shm segments are 0600 whatever the umask (host/shm.py). This
        # process is the engine's own Ray worker and writes nothing a user reads.
        os.umask(0o077)
        # vLLM binds those sockets under $VLLM_RPC_BASE_PATH and never unlinks them: a directory of this
        # engine's own (host/rpc_dirs.py), removed with the engine in shutdown(); its TP workers inherit it.
        from colocate.host.rpc_dirs import create_rpc_dir

        self._rpc_dir = create_rpc_dir()
        os.environ["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        if self.device == "cpu" and self.cfg.tp > 1:
            # the TP workers fork from a server that imports their code once, starting now (engine/worker_start.py)
            from colocate.engine.worker_start import start_worker_server

            start_worker_server()
        import vllm  # noqa: F401 -- the import is the work

        self._prepared = True

    def start(self, adapter_shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
        """Build the engine. `adapter_shapes` (a LoRA job: the trainer's adapter tensors, name -> shape): install
        the policy's adapter in every worker, zeros until the first sync (engine/lora.py)."""
        self.prepare()
        from vllm import LLM

        if self.device == "cpu":
            from colocate.engine.cpu_polling import stop_busy_polling

            stop_busy_polling()

        started = time.perf_counter()
        self._adapter_shapes = dict(adapter_shapes or {})
        assert bool(self._adapter_shapes) == bool(self.cfg.max_lora_rank), "a LoRA engine starts with its adapter"
        try:
            self.llm = LLM(**self._llm_kwargs())
        except Exception as e:  # vLLM raises many types; the controller needs one clear line
            raise EngineStartError(f"vLLM engine failed to start for {self.model_path!r}: {_root_cause(e)}") from None
        self._watch_workers()
        from colocate.host.shm import vllm_entries  # which vLLM never unlinks: shutdown() does

        self._worker_entries = vllm_entries(os.getpid())
        from colocate.sync.engine_end import EngineEnd  # here: it imports torch, which prepare() must precede

        self.sync_end = EngineEnd(self.llm.collective_rpc, device=self.device)
        if adapter_shapes:
            from colocate.engine.lora import policy_adapter

            self.llm.collective_rpc("colocate_install_adapter", args=(adapter_shapes,))
            self._adapter = policy_adapter()
        if self.capture_routing:
            self.llm.collective_rpc("colocate_capture_routing")
        return {"start_s": time.perf_counter() - started, **self.memory()[0],
                "logits_dtype": self.llm.collective_rpc("colocate_logits_dtype")[0]}

    def _llm_kwargs(self) -> dict:
        """vLLM's engine arguments for the policy: generation from token ids, with the sampled tokens' logprobs."""
        assert self.cfg.enforce_eager in ("true", "false"), "decided in the driver (job/resolve.py)"
        kwargs = dict(
            model=self.model_path,
            tensor_parallel_size=self.cfg.tp,
            dtype=self.cfg.dtype,
            max_model_len=self.cfg.max_model_len,
            # CUDA graphs on GPU by default; on the CPU eager mode starts in seconds instead of minutes
            enforce_eager=self.cfg.enforce_eager == "true",
            enable_prefix_caching=self.cfg.enable_prefix_caching,
            enable_expert_parallel=self.cfg.expert_parallel,
            seed=self.cfg.seed,
            skip_tokenizer_init=True,
            worker_extension_cls=EXTENSION,
            # the logprobs of the distribution tokens were sampled from (after temperature and top-p), the
            # behaviour policy of the loss; raw logprobs would be those of the unscaled logits
            # With speculative decoding, raw: vLLM 0.32's rejection sampler returns some accepted drafts' processed
            # log-probs as 0.0 (v1/sample/rejection_sampler.py `_get_logprobs_tensors`; none of its raw ones are),
            # and the config allows it only at temperature 1 and top_p 1, where the two are the same distribution
            logprobs_mode="raw_logprobs" if self.speculative else "processed_logprobs",
            **({"speculative_config": self.speculative} if self.speculative else {}),
            **({"max_num_seqs": self.cfg.max_num_seqs} if self.cfg.max_num_seqs else {}),
            **(_lora_kwargs(self.cfg.max_lora_rank, self._adapter_shapes) if self.cfg.max_lora_rank else {}),
            **engine_extra_args(self.cfg),
        )
        if self.cfg.fp32_lm_head:
            kwargs["hf_overrides"] = head_dtype_override(kwargs.get("hf_overrides"))
        if self.cfg.native_rotary:
            kwargs["compilation_config"] = without_rotary_kernel(kwargs.get("compilation_config"))
        if self.device == "cpu":
            # TP=1 runs its worker in this process ("uni"), as vLLM itself chooses on CUDA (config/parallel.py:
            # a world size of 1 with no backend given), so the CPU tests the GPU's TP=1 path; a worker process
            # would cost a second import of torch and vLLM (about 16 CPU-s here) for nothing
            kwargs.update(distributed_executor_backend="mp" if self.cfg.tp > 1 else "uni",
                          kv_cache_memory_bytes=int(self.cfg.kv_cache_gib * (1 << 30)))
            # Whole prefills only: a prefill split over two steps discards the first step's sample, and vLLM 0.32
            # rewinds that request's seeded generator by set_offset (v1/worker/gpu_model_runner.py
            # `_bookkeeping_sync`), which a CPU torch.Generator does not have ("CPU Generator does not use
            # offset"): every answer here is seeded, and a pass of many long continuations (a recompute after an
            # update inside the pass, a partial rollout's next segments) outgrows one step's token budget. The
            # budget must then hold the longest prompt (vLLM's check), and engine.extra_args may still set both.
            extra = engine_extra_args(self.cfg)
            if "enable_chunked_prefill" not in extra:
                kwargs["enable_chunked_prefill"] = False
                kwargs["max_num_batched_tokens"] = extra.get("max_num_batched_tokens",
                                                             max(self.cfg.max_model_len,
                                                                 CPU_PREFILL_TOKENS * self.cfg.tp))
        else:
            kwargs.update(distributed_executor_backend="ray" if self.cfg.tp > 1 else None,
                          gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                          enable_sleep_mode=self.sleep_backend == "vllm",
                          # MoE experts on Triton, which computes on the loaded layout (vLLM 0.32,
                          # fused_moe/oracle/unquantized.py `convert_to_unquantized_kernel_format`: Triton only
                          # makes w13/w2 contiguous). CUDA's default order tries FlashInfer first off Hopper,
                          # which swaps w13's halves (CUTLASS: [up | gate]) or re-blocks it (TRT-LLM): the sync
                          # and its verification write and read [gate | up] per expert. No effect on dense models.
                          moe_backend="triton")
            if self.update_in_pass:
                # One batch in flight at most: vLLM 0.32 schedules the next step while the last runs on CUDA at
                # TP=1 (async scheduling, the uni executor's default), so a pause between two step() calls could
                # leave a batch of the old weights to come out tagged with the new version. The CPU build and the
                # Ray executor (TP > 1) schedule synchronously already.
                kwargs["async_scheduling"] = False
        return kwargs

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        if self._worker_entries:  # once its stopped workers unmapped them; any still mapped: the job's release
            from colocate.host.shm import remove_when_unmapped

            remove_when_unmapped(self._worker_entries)
            self._worker_entries = set()
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    # ----------------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], sampling: dict) -> list[list[dict]]:
        """For each prompt, `n` samples of {token_ids, logprobs (of each sampled token), finish_reason}; with
        sampling["prompt_logprobs"], each also has the logprob of every prompt token after the first, from one
        prefill pass over the prompt (vLLM's prompt_logprobs: of the raw logits, whatever the temperature)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        assert not self._asleep, f"generate() while the engine's {sorted(self._asleep)} sleep: wake them first"

        n, seed = sampling["n"], sampling.get("seed")
        # sampling["routing"] (algo.router_replay): one request a sample, its id naming its rows
        # (engine/routing.py), seeded one apart; each sample then carries its routing
        routed = self.capture_routing and sampling.get("routing", False)
        copies = n if routed else 1
        params = [SamplingParams(
            n=n // copies, temperature=sampling["temperature"], top_p=sampling["top_p"],
            max_tokens=sampling["max_tokens"], seed=None if seed is None else seed + i, logprobs=0,
            detokenize=False, stop_token_ids=[self.eos_token_id] if self.eos_token_id is not None else None,
            prompt_logprobs=0 if sampling.get("prompt_logprobs") else None,
        ) for _ in prompts for i in range(copies)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(copies)],
                                    params, use_tqdm=False, lora_request=self._adapter)
        routing = self.take_routing([out.request_id for out in outputs]) if routed else {}
        samples = [
            [
                {
                    "token_ids": list(c.token_ids),
                    # logprobs=0 returns only the sampled token's logprob at each position
                    "logprobs": [next(iter(lp.values())).logprob for lp in c.logprobs],
                    "finish_reason": c.finish_reason,
                    **({"prompt_logprobs": _prompt_logprobs(out)} if sampling.get("prompt_logprobs") else {}),
                    **({"routing": routing.get(out.request_id)} if routed else {}),
                }
                for c in out.outputs
            ]
            for out in outputs
        ]
        return [sum(samples[i:i + copies], []) for i in range(0, len(samples), copies)]

    def take_routing(self, request_ids: list[str]) -> dict:
        """algo.router_replay: each request's routed experts, uint16 [positions, layers, top_k] (engine/routing.py),
        from the TP rank that captures them."""
        return next(r for r in self.llm.collective_rpc("colocate_take_routing", args=(request_ids,))
                    if r is not None)

    def run_pass(self, requests: list, sampling: dict, num_groups_wanted: int | None = None,
                 version: int = 0, stream: bool = False) -> dict:
        """One rollout pass, step by step (engine.requests): stops once `num_groups_wanted` groups are complete
        and aborts the rest, keeping their tokens for a continuation. `version`: the policy it was planned under; a
        weight update may enter it (pause_pass, resume_pass), its tokens then tagged with the new version.
        `stream` (rollout.stream): requests are fed into it (stream_feed) and results leave as they finish
        (stream_drain); it returns the rest when it has nothing left to run."""
        from colocate.engine.requests import run_pass

        assert not self._asleep, f"run_pass() while the engine's {sorted(self._asleep)} sleep: wake them first"
        started = time.perf_counter()
        results, timeline = run_pass(self.llm, requests, sampling, num_groups_wanted=num_groups_wanted,
                                     eos_token_id=self.eos_token_id, lora_request=self._adapter, version=version,
                                     gate=self._gate, stream=self._stream if stream else None,
                                     routing=self.take_routing if self.capture_routing else None)
        return {"results": results, "timeline": timeline, "seconds": time.perf_counter() - started,
                "parked_s": self._gate.parked_s,
                "decode": {"request_steps": self._gate.request_steps, "tokens": self._gate.tokens}}

    @ray.method(concurrency_group=STREAM)
    def stream_feed(self, requests: list) -> bool:
        """rollout.stream: more requests for the pass in flight; False when it has ended (they are the caller's)."""
        return self._stream.feed(requests)

    @ray.method(concurrency_group=STREAM)
    def stream_drain(self, wait_s: float = 0.0) -> dict:
        """rollout.stream: the results finished since the last drain (waiting up to `wait_s` for one), and the
        engine steps run since then: their busy timeline and decode counters (the pass's own return has
        neither)."""
        results = self._stream.drain(wait_s)
        steps, (request_steps, tokens) = self._stream.progress()
        return {"results": results, "timeline": steps, "decode": {"request_steps": request_steps, "tokens": tokens}}

    @ray.method(concurrency_group=CONTROL)
    def pause_pass(self) -> bool:
        """Hold the engine for a weight update (engine/pass_gate.py): returns between two steps of the pass in
        flight, or at once when none is; no pass starts until resume_pass. Whether a pass is parked."""
        return self._gate.pause()

    @ray.method(concurrency_group=CONTROL)
    def pass_progress(self) -> dict:
        """The pass in flight, read while it runs: whether there is one, its engine steps so far, and the policy
        version of the weights."""
        return {"in_pass": self._gate.in_pass, "steps": self._gate.steps, "version": self._gate.version}

    @ray.method(concurrency_group=CONTROL)
    def resume_pass(self, version: int, kv: str, end: bool = False) -> None:
        """The weights are policy `version` now: the parked pass goes on. `kv` (rollout.update_in_pass): keep the
        KV of the answers in flight, or recompute it (vLLM preempts them; they prefill again with the new
        weights before their next token). `end` (the rollout closes): the pass aborts what is unfinished and
        returns at its next step."""
        if not self._gate.held:
            return  # resumed already: a close after a step whose update failed on another engine
        try:
            if kv == "recompute" and self._gate.holds_blocks:
                self.llm.reset_prefix_cache(reset_running_requests=True)
        except BaseException:
            self._gate.resume(version, end=True)  # its answers go on next pass, prefilled again, or the job stops
            raise
        self._gate.resume(version, end=end, stale_cache=kv == "keep")

    # ----------------------------------------------------------------------------------------- weight sync

    @ray.method(concurrency_group=CONTROL)
    def share_weights(self) -> list[dict]:
        """Move every worker's parameters into a shared-memory arena (in-place sync); per worker: tp_rank,
        handle, offsets."""
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.sync_end.share_weights()

    def node_id(self) -> str:
        """The Ray node of this engine (its TP workers share it: placement.plan_nodes)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def device_names(self) -> list[str]:
        """Each worker's device (by TP rank), named alike in every process (devices.device_name)."""
        return self.llm.collective_rpc("colocate_device_name")

    @ray.method(concurrency_group=CONTROL)
    def open_ring(self, key: str, plan, *, shared: bool = False, engine_index: int | None = None,
                  broadcast: dict | None = None) -> list:
        """Give every worker a ring for sync `key`; returns their handles (by TP rank) for the trainers. Each
        worker owns a ring on its own device; `shared` (CPU, full-tensor plan written by every rank): the
        workers share one segment, since they read the same full tensors; in place, the handles are the
        workers' weight arenas. A new plan (another layout, a restarted engine) gets new rings.
        `engine_index`: this engine's index in the sync, named by its verification errors. `broadcast` (split
        placement, sync/broadcast.py): {"addresses": {TP rank: StoreAddress}, "num_members", "timeout_s"}; each
        worker's ring is then its own memory, filled by the broadcast of its TP rank's group, which it joins here
        (this returns once the feeders joined too)."""
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.sync_end.open_ring(key, plan, shared=shared, engine_index=engine_index, broadcast=broadcast)

    @ray.method(concurrency_group=CONTROL)
    def receive_bucket(self, key: str, index: int) -> dict:
        """Broadcast sync: every worker receives its slice of bucket `index` into its ring slot (a collective with
        the feeders' broadcast_write of it). The load that follows checks it. Returns the slowest worker's
        seconds, and of applying a delta (EngineEnd.receive_bucket)."""
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.sync_end.receive_bucket(key, index)

    @ray.method(concurrency_group=CONTROL)
    def seal_ring(self, key: str) -> None:
        """Everyone has mapped the rings: drop their names so no crash can leak a segment."""
        with self._gate.exclusive():
            self.sync_end.seal_ring(key)

    @ray.method(concurrency_group=CONTROL)
    def close_ring(self, key: str) -> None:
        """Drop sync `key`'s rings and groups (reopened under a new key for a replaced engine)."""
        with self._gate.exclusive():
            self.sync_end.close_ring(key)

    @ray.method(concurrency_group=CONTROL)
    def load_bucket(self, key: str, index: int, *per_rank_checksums) -> dict:
        """Load bucket `index` into every worker. Ray passes the trainers' write results as arguments, so this
        runs only after every rank has written its part of the bucket. Each worker verifies its ranges before it
        copies any (sync/load.py): a corrupted slot raises SyncVerificationError naming the tensor, unloaded."""
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.sync_end.load_bucket(key, index, per_rank_checksums)

    @ray.method(concurrency_group=CONTROL)
    def verify_in_place(self, key: str, *per_rank_checksums) -> dict:
        """After the trainers wrote every bucket in place (Ray passes their results, so this runs after them):
        check every worker's parameters still live in its arena, and the written ranges' checksums; then the
        post-load step (one call fewer per sync than through the ring)."""
        with self._gate.exclusive():
            return {**self.sync_end.verify_in_place(key, per_rank_checksums), "post_s": self.finish_sync()}

    @ray.method(concurrency_group=CONTROL)
    def finish_sync(self) -> float:
        """Post-load processing, once per sync. Returns its seconds."""
        started = time.perf_counter()
        # Hazard: cached prefixes were computed with the old weights. A parked pass's requests hold blocks, so
        # the reset waits for resume_pass (recompute) or for the pass's end (keep): engine/pass_gate.py.
        with self._gate.exclusive():
            if self._gate.holds_blocks:
                self._gate.updated_in_pass = True
            else:  # a pass parked before its requests were added holds none: its prefills see the new weights
                self.llm.reset_prefix_cache()
        return time.perf_counter() - started

    @ray.method(concurrency_group=CONTROL)
    def load_state(self, state: dict) -> None:
        """Naive baseline: a whole state dict (arrived through Ray's object store) into every worker."""
        with self._gate.exclusive():
            self.llm.collective_rpc("colocate_load_state", args=(state,))
            self.finish_sync()

    @ray.method(concurrency_group=CONTROL)
    def state_dicts(self) -> list[dict]:
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.llm.collective_rpc("colocate_state_dict")

    @ray.method(concurrency_group=CONTROL)
    def param_layouts(self) -> list[dict]:
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.llm.collective_rpc("colocate_param_layout")

    # -------------------------------------------------------------------------------------- memory switch

    def sleep(self, level: int) -> int:
        """Free weights and KV cache (level 2: weights discarded, sync restores them). Returns bytes freed."""
        self._asleep = {"weights", "kv_cache"}
        self._sleep_level = level
        if self.sleep_backend == "vllm":
            return self._freed_on_devices(lambda: self.llm.sleep(level=level))
        return sum(self.llm.collective_rpc("colocate_sleep", args=(level,)))

    def wake(self, tags: list[str], commit: bool = False) -> int:
        """Wake by tags: "weights" before the sync writes them, "kv_cache" after (never both copies at once)."""
        if self.sleep_backend == "vllm":
            restored = -self._freed_on_devices(lambda: self.llm.wake_up(tags=tags))
        else:
            restored = sum(self.llm.collective_rpc("colocate_wake", args=(tags, commit)))
        if "weights" in tags and self._sleep_level == 2 and self._adapter is not None:
            # the adapter's buffers were discarded with the weights: zeros before the sync writes the adapter
            self.llm.collective_rpc("colocate_reset_adapter")  # (engine/lora.py reset_adapter)
        if "kv_cache" in tags:
            self.llm.reset_prefix_cache()  # the KV cache came back without its contents
        self._asleep -= set(tags)
        return restored

    def _freed_on_devices(self, action) -> int:
        """Bytes the driver reports freed on the workers' GPUs by `action` (vLLM's sleep and wake return nothing;
        negative: memory taken)."""
        before = self.llm.collective_rpc("colocate_device_free_bytes")
        action()
        after = self.llm.collective_rpc("colocate_device_free_bytes")
        return sum(a - b for a, b in zip(after, before))

    @ray.method(concurrency_group=CONTROL)
    def memory(self) -> list[dict]:
        with self._gate.exclusive():  # a pass in flight parks meanwhile
            return self.llm.collective_rpc("colocate_memory")

    # ----------------------------------------------------------------------------------------- liveness

    @ray.method(concurrency_group=PROBE)
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group=PROBE)
    def stalled_s(self) -> float | None:
        """Seconds since this engine's rollout pass last stepped: the controller's engine heartbeat
        (fault.engine_timeout_s); None when no pass runs. Answered from the probe thread while a step hangs."""
        return self._gate.stalled_s()

    def _workers(self) -> list:
        """vLLM's worker process handles (the multiprocessing executor, TP > 1 on the CPU; empty at TP=1, whose
        worker runs in this process, and for the Ray executor, whose workers are Ray actors).
        vllm/v1/engine/llm_engine.py keeps `model_executor` when the engine core runs in this process
        (VLLM_ENABLE_V1_MULTIPROCESSING=0, as engine_env sets)."""
        executor = getattr(self.llm.llm_engine, "model_executor", None) if self.llm is not None else None
        return list(getattr(executor, "workers", None) or [])

    @ray.method(concurrency_group=PROBE)
    def worker_pids(self) -> list[tuple[int, int]]:
        """(TP rank, pid) of each worker process, for the controller's watchdog (colocate.job.faults)."""
        return [(h.rank, h.proc.pid) for h in self._workers()]

    @ray.method(concurrency_group=PROBE)
    def worker_deaths(self) -> list[tuple[int, int, int | None]]:
        """(TP rank, pid, exit code) of each worker that exited, in the order they did; a negative code is the
        signal. The first is the cause: once one worker dies, vLLM's executor terminates the others (SIGTERM)."""
        return list(self._deaths)

    def _watch_workers(self) -> None:
        """A thread that records each worker's exit as it happens (on the CPU their forkserver reaps them and
        reports each exit code through the sentinel, engine/worker_start.py). Asked only after the fact, vLLM's
        shutdown has already replaced the first death's code with its own."""
        import multiprocessing.connection
        import threading

        self._deaths: list[tuple[int, int, int | None]] = []
        pending = {h.proc.sentinel: h for h in self._workers()}

        def watch():
            while pending:
                for sentinel in multiprocessing.connection.wait(list(pending)):
                    handle = pending.pop(sentinel)
                    # The sentinel (a pipe) closes as the process exits, a moment before the kernel can report
                    # its status: join() may return with no exit code yet (seen in CI), so poll for it.
                    deadline = time.monotonic() + 5
                    while _exit_code(handle.proc) is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                    self._deaths.append((handle.rank, handle.proc.pid, _exit_code(handle.proc)))

        threading.Thread(target=watch, name="colocate-worker-deaths", daemon=True).start()


def _exit_code(proc) -> int | None:
    try:
        return proc.exitcode
    except ValueError:  # vLLM's shutdown closed the process object: its status is gone with it
        return None


def _lora_kwargs(max_lora_rank: int, adapter_shapes: dict[str, tuple[int, ...]]) -> dict:
    """vLLM's LoRA arguments for the policy's one adapter. max_loras=1: a slot for it alone (every request carries
    it, engine/lora.py); max_cpu_loras=1: no second copy registered; lora_target_modules: the projections the
    trainer adapts, so vLLM wraps nothing else (a MoE model's experts above all: engine/lora.py)."""
    from colocate.engine.lora import adapter_targets

    return dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=1,
                lora_target_modules=adapter_targets(adapter_shapes))


def _root_cause(e: BaseException) -> str:
    """The informative line of vLLM's error: for pydantic's "1 validation error for X", the error under it."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) > 1 and re.match(r"^\d+ validation errors? for ", lines[0]):
        detail = lines[1].removeprefix("Value error, ").split(" [type=")[0]
        return detail.split(". ")[0].rstrip(".") + "."
    return f"{type(e).__name__}: {lines[0] if lines else ''}"
