"""The worker extension: what the controller can ask of every vLLM worker (through `collective_rpc`).

vLLM mixes this class into its worker class (`worker_extension_cls`), so `self` is the vLLM worker,
`self.model_runner.model` its model and `self.device` its device (set by the worker's `init_device`: `cuda:<i>`
in `v1/worker/gpu_worker.py`, `cpu` in `cpu_worker.py`). Every device call names `self.device`: a
`collective_rpc` may run on a thread whose current CUDA device is not the worker's (vLLM's own IPC weight
transfer engine says so: `distributed/weight_transfer/ipc_engine.py`, "the current device is not guaranteed to
match self.device"), so `torch.cuda.current_device()` and argument-less `synchronize()` /
`mem_get_info()` could read another GPU. Only the model runner's `model` and `kv_caches` are read from the
runner: its V2 version (CUDA's default) has little else that the V1 one (the CPU's) has
(tests/unit/test_engine_runner_api.py). Method names carry a `colocate_` prefix: the worker class already has
`sleep`, `wake_up`, `load_model`, ... and vLLM refuses an extension whose names collide.

    llm = LLM(path, worker_extension_cls="colocate.engine.extension.ColocateWorkerExtension", ...)
    handles = llm.collective_rpc("colocate_open_ring", args=(key, plan))
    llm.collective_rpc("colocate_load", args=(key, bucket_index, checksums))   # verify, then copy (sync/load.py)

Hazard (CPU weight layout): on CPUs with AVX-512 bf16 / AMX, vLLM's CPU backend repacks every linear weight
into an opaque oneDNN/SGL kernel format after loading and empties the parameter (and keeps a packed copy of
lm_head beside the live weight). A later `load_weights` then writes into an empty parameter, or the engine
keeps computing with the stale packed copy. Importing this module in the worker (vLLM imports the extension
before it loads the model) switches CPU linear layers to plain `F.linear` on the loaded weight, so weights stay
where sync writes them, sleep can release their storages and verification can read them. The cost is vLLM's
packed CPU GEMM; a later sync path that writes the packed format directly can lift it.
"""

from __future__ import annotations

import os

import torch

from colocate.engine.experts import expert_report
from colocate.engine.lora import engine_tensors, experts_carry_no_lora, install_adapter, reset_adapter, shape_2d
from colocate.engine.worker_exit import exit_without_finalization
from colocate.host.memory import process_rss_bytes, return_free_memory_to_os
from colocate.sync.engine_end import WorkerEnd
from colocate.sync.reshard import SyncPlan


def _use_plain_cpu_linear() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    def plain(self, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    UnquantizedLinearMethod.process_weights_after_loading = plain
    UnquantizedEmbeddingMethod.process_weights_after_loading = plain


def _cpu_only_patches() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from colocate.engine.cpu_moe import use_plain_cpu_experts
        from colocate.engine.cpu_polling import stop_busy_polling

        _use_plain_cpu_linear()
        use_plain_cpu_experts()
        stop_busy_polling()


_cpu_only_patches()
experts_carry_no_lora()  # a LoRA job's MoE experts keep their kernel (engine/lora.py); every platform
exit_without_finalization()  # a TP worker that shut down cleanly exits without 2.6 s of teardown


class ColocateWorkerExtension:
    # ----------------------------------------------------------------------------------------- weight sync
    # Several syncs may be open at once on one engine (the benchmark runs its baselines beside the real one):
    # each has a key, and its own plan and ring here.

    def _colocate_sync(self) -> WorkerEnd:
        """This worker's end of every sync open on it (sync/engine_end.py)."""
        if getattr(self, "_colocate_end", None) is None:
            self._colocate_end = WorkerEnd(device=self.device)
        return self._colocate_end

    def colocate_share_weights(self) -> dict:
        """Move this worker's parameters into a shared-memory arena the trainers can write in place (CPU), unless
        they are in one that can still be mapped (WorkerEnd.share_weights). Returns its handle and every
        parameter's byte offset."""
        from vllm.distributed import get_tensor_model_parallel_rank

        end = self._colocate_sync()
        if not end.arena_linked():
            sleeper = getattr(self, "_colocate_sleeper", None)
            assert sleeper is None or not sleeper.asleep, "share the weights while the engine is awake"
            end.share_weights(engine_tensors(self))
            return_free_memory_to_os()  # the parameters' old storages
            if sleeper is not None:
                sleeper.arena = end.arena
        return {"tp_rank": get_tensor_model_parallel_rank(), "handle": end.arena.handle, "offsets": end.arena.offsets}

    def colocate_open_ring(self, key: str, plan: SyncPlan, shared_handle=None, engine_index: int | None = None,
                           broadcast: dict | None = None):
        """This worker's ring for sync `key` (WorkerEnd.open_ring); returns the handle the trainers map."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return self._colocate_sync().open_ring(key, plan, tp_rank=get_tensor_model_parallel_rank(),
                                               params=engine_tensors(self), shared_handle=shared_handle,
                                               engine_index=engine_index, broadcast=broadcast)

    def colocate_seal_ring(self, key: str) -> None:
        self._colocate_sync().seal(key)

    def colocate_close_ring(self, key: str) -> None:
        self._colocate_sync().close(key)

    # Verification failures are returned, not raised (sync/engine_end.py says why): (seconds..., error or None).

    def colocate_load(self, key: str, index: int, checksums: list[tuple[int, int, int, int]]):
        return self._colocate_sync().load(key, index, checksums, self.model_runner.model.load_weights)

    def colocate_receive(self, key: str, index: int):
        return self._colocate_sync().receive(key, index)

    def colocate_verify_in_place(self, key: str, checksums: list[tuple[int, int, int, int]]):
        return self._colocate_sync().verify_in_place(key, checksums)

    def colocate_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of this worker's parameters (engine names, TP-local), and a LoRA job's adapter buffers, for full
        verification in tests/bench."""
        return {name: t.detach().reshape(shape_2d(name, t)).to("cpu", copy=True)
                for name, t in engine_tensors(self).items()}

    def colocate_device_name(self) -> str:
        """This worker's device, named alike in every process: the GPU's UUID (vLLM's Ray workers see every GPU
        and pick one by local rank, so the index says nothing), or on the CPU the slot the runtime gave this
        TP rank (COLOCATE_ENGINE_SLOTS, set by placement.engine_placement)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from colocate.host.devices import device_name

        if self.device.type == "cuda":
            return device_name(self.device)
        slots = os.environ["COLOCATE_ENGINE_SLOTS"].split(",")
        return device_name(self.device, slot=int(slots[get_tensor_model_parallel_rank()]))

    def colocate_device_free_bytes(self) -> int:
        """Free memory of this worker's GPU as the driver sees it (what vLLM's sleep mode hands back)."""
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    def colocate_logits_dtype(self) -> str:
        """The dtype this worker makes its logits in, as its LogitsProcessor decided it (head_dtype: engine.
        fp32_lm_head), read from the model that runs, not from the config."""
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        model = self.model_runner.model
        heads = [m.head_dtype for m in model.modules() if isinstance(m, LogitsProcessor)]
        dtype = heads[0] if heads and heads[0] is not None else next(model.parameters()).dtype
        return str(dtype).removeprefix("torch.")

    def colocate_capture_routing(self) -> None:
        """algo.router_replay: capture the experts every token is routed to (engine/routing.py), on TP rank 0
        (every rank routes every token alike: TP and EP hand each rank the whole batch)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from colocate.engine.routing import RoutingCapture

        if get_tensor_model_parallel_rank() == 0 and getattr(self, "_colocate_routing", None) is None:
            self._colocate_routing = RoutingCapture(self.model_runner)

    def colocate_take_routing(self, request_ids: list[str]):
        """The captured routing of these requests (RoutingCapture.take), from TP rank 0; None on the others."""
        capture = getattr(self, "_colocate_routing", None)
        return None if capture is None else capture.take(request_ids)

    def colocate_param_layout(self) -> dict:
        """This worker's parameters (names, shapes, dtypes), TP rank, and for a MoE model its experts: which global
        experts its slots hold and how their intermediate dimension is split (the reshard plan needs both)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return {
            "tp_rank": get_tensor_model_parallel_rank(),
            "tp_size": get_tensor_model_parallel_world_size(),
            "params": [(n, shape_2d(n, t), str(t.dtype)) for n, t in engine_tensors(self).items()],
            "experts": expert_report(self.model_runner.model),
        }

    # ------------------------------------------------------------------------------------- portable sleep

    def colocate_install_adapter(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """A LoRA job: the policy's adapter, all zeros, in this worker's slot (engine/lora.py)."""
        install_adapter(self, shapes)

    def colocate_reset_adapter(self) -> None:
        """After a level-2 wake: the adapter's buffers zeroed, vLLM's LoRA metadata rewritten (engine/lora.py)."""
        reset_adapter(self)

    def colocate_sleep(self, level: int) -> int:
        from colocate.engine.sleep import PortableSleep

        if getattr(self, "_colocate_sleeper", None) is None:
            self._colocate_sleeper = PortableSleep(self.model_runner.model, self.model_runner.kv_caches,
                                                   arena=self._colocate_sync().arena)
        return self._colocate_sleeper.sleep(level)

    def colocate_wake(self, tags: list[str], commit: bool = False) -> int:
        return self._colocate_sleeper.wake(tags, commit=commit)

    def colocate_rss(self) -> int:
        """This worker's memory: its private pages, plus the shared segments it owns (weight arena, rings)
        counted whole and once, not through whichever of their pages this process happened to touch."""
        shared = sum(o.resident_bytes() for o in self._colocate_sync().owned() if hasattr(o, "resident_bytes"))
        return process_rss_bytes(shared_memory=False) + shared

    def colocate_memory(self) -> dict:
        model = self.model_runner.model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        seen, kv = set(), 0
        for t in self.model_runner.kv_caches:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                kv += storage.nbytes()
        from colocate.host.devices import device_memory

        return {"weight_bytes": weights, "kv_cache_bytes": kv, "rss_bytes": self.colocate_rss(), "pid": os.getpid(),
                **device_memory(self.device)}

    def colocate_load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a whole HF state dict through vLLM's loaders (the benchmark's naive baseline)."""
        self.model_runner.model.load_weights(weights=list(state.items()))
