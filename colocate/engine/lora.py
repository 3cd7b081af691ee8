"""The engine's side of a LoRA job: one adapter, installed in memory when the engine starts, then written in place by
every sync, like any other tensor the sync moves.

    install_adapter(worker, shapes, rank)   # in each TP worker, after the model loaded (zeros: step 0's B is 0)
    views = adapter_views(worker)           # "model.layers.0.self_attn.q_proj.lora_B.weight" -> its slot's buffer
    llm.generate(..., lora_request=policy_adapter())

vLLM 0.32 loads adapters from disk only (`WorkerLoRAManager._load_adapter` reads adapter_config.json). What it does
with the tensors after reading them is public enough to call directly, in the worker (vllm/lora/worker_manager.py
`_load_adapter` and `LRUCacheWorkerLoRAManager.add_adapter`, the load_inplace branch): `LoRAModel.from_lora_tensors`
with the model's rename mapper, then the adapter manager's `add_adapter` (packs q/k/v and gate/up per sub-layer),
`activate_adapter` (the first free slot: `set_lora` copies each sub-layer's A and B, sliced for TP, into the layer's
fixed `lora_a_stacked` / `lora_b_stacked` buffers) and `pin_adapter` (never evicted: an eviction would re-read the
request's path, which names no directory).

Layouts (vllm/lora/layers/base_linear.py `create_lora_weights`, column_parallel_linear.py, row_parallel_linear.py):
per sub-layer s of a wrapped module, A in `lora_a_stacked[s][slot, 0]` [max_lora_rank, in] and B in
`lora_b_stacked[s][slot, 0]` [out, max_lora_rank]; column-parallel layers (q/k/v, gate/up) hold all of A and their
TP rows of B, row-parallel ones (o, down) their TP columns of A and all of B. The sync's reshard rules
(sync/reshard.py) write exactly those blocks. vLLM folds the adapter's scaling into B when it loads one
(`LoRALayerWeights.optimize`) and computes with scale 1: the trainer sends B already scaled (trainer/lora.py), and
the adapter here is declared with alpha = rank (scale 1), so the two agree.

Hazards:
- Buffer identity: the slot views alias the buffers vLLM's kernels read (on CUDA, Triton caches their pointers and
  CUDA graphs capture them): the sync only ever copies into them, never rebinds them.
- The prefix cache hashes an adapter's name and path, not its weights: the engine resets it after every sync, as
  it does for the base weights.
- vLLM's CPU LoRA path gives a token with no adapter the last slot's (punica_cpu): every request of a LoRA job
  carries the adapter, so no batch mixes the two.
- Which modules vLLM wraps: all it supports unless `lora_target_modules` names some (vllm/lora/model_manager.py
  `_create_lora_modules`), MoE experts included, whose LoRA layer (lora/layers/fused_moe.py) has a layout no
  trainer tensor maps to. The engine names the trainer's projections (`adapter_targets`): only they are wrapped,
  and a MoE model's experts stay plain (`experts_carry_no_lora`).
- A level-2 sleep discards the adapter's buffers with the weights (`reset_adapter`).
"""

from __future__ import annotations

import torch

from colocate.sync.tp_layout import is_adapter

ADAPTER_ID = 1
ADAPTER_NAME = "colocate-policy"
PEFT_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<module>.lora_A.weight


def policy_adapter():
    """The request every generation of a LoRA job carries (the path is never read: the adapter is pinned)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, lora_path="colocate:in-memory")


def _adapter_manager(worker):
    manager = getattr(worker.model_runner, "lora_manager", None)
    assert manager is not None, "the engine runs without enable_lora"
    return manager._adapter_manager


def adapter_targets(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The projections the trainer adapts (`q_proj`, ...), from its adapter tensors' names: the engine's
    `lora_target_modules`, so vLLM wraps those and nothing else (packed modules by their parts: qkv_proj when
    any of q/k/v is named, lora/utils.py `is_in_target_modules`)."""
    return sorted({name.split(".lora_")[0].rsplit(".", 1)[1] for name in shapes})


def install_adapter(worker, shapes: dict[str, tuple[int, ...]]) -> None:
    """Register, activate and pin the policy's adapter in this worker, all zeros. `shapes`: the trainer's adapter
    parameters (name -> shape, PEFT names without the prefix; A is [rank, in]). Zeros are the step-0 policy: the
    trainer's B starts at 0, so base and adapter compute the same; the first sync writes the trainer's A and B."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    targets = adapter_targets(shapes)
    rank = next(shape[0] for name, shape in shapes.items() if name.endswith(".lora_A.weight"))
    helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": targets,
                                   "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    tensors = {PEFT_PREFIX + name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=ADAPTER_ID, tensors=tensors, peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters.remove_adapter(ADAPTER_ID)
    adapters.add_adapter(lora)
    adapters.activate_adapter(ADAPTER_ID)
    adapters.pin_adapter(ADAPTER_ID)


def adapter_views(worker) -> dict[str, torch.Tensor]:
    """Each adapter tensor's buffer in this worker, under the trainer's name for it (`...q_proj.lora_A.weight`):
    the whole stacked buffer of each sub-layer, [1, 1, max_lora_rank, in] for A and [1, 1, out, max_lora_rank] for
    B. With one slot (max_loras=1) the buffer is the slot: the same bytes as its [slot, 0] view, and a tensor
    whose storage the in-place sync's arena can take over (sync/arena.py swaps `.data`, which a view would not
    pass on to the buffer vLLM computes with)."""
    adapters = _adapter_manager(worker)
    assert adapters.lora_index_to_id == [ADAPTER_ID], adapters.lora_index_to_id
    views = {}
    for module_name, module in adapters.modules.items():
        # only the trainer's projections are wrapped (lora_target_modules): linear layers, one A and B per part
        assert hasattr(module, "lora_a_stacked"), f"vLLM wrapped {module_name} ({type(module).__name__}) for LoRA"
        sub_names = adapters.packed_modules.get(module_name, [module_name])
        assert len(sub_names) == len(module.lora_a_stacked), (module_name, sub_names)
        for s, sub in enumerate(sub_names):
            views[f"{sub}.lora_A.weight"] = module.lora_a_stacked[s]
            views[f"{sub}.lora_B.weight"] = module.lora_b_stacked[s]
    return views


def reset_adapter(worker) -> None:
    """After a level-2 wake, before the sync writes the adapter: zero every LoRA buffer this worker holds and make
    vLLM rewrite its LoRA metadata at the next batch, so nothing a discarded page held survives.

    Why (vLLM 0.32): the LoRA layers and the punica wrapper's metadata are allocated while the model loads
    (v1/worker/gpu_worker.py `load_model`, under the cumem pool tagged "weights"; lora/layers/base_linear.py
    `create_lora_weights`, lora/punica_wrapper/punica_base.py). A level-2 sleep discards that pool
    (device_allocator/sleep_mode_backend.py `CuMemBackend.suspend` offloads only "runtime" and "cudagraph"), and
    wake maps fresh physical memory (device_allocator/cumem.py `CuMemAllocator.wake_up`: `create_and_map`, zeroed
    on ROCm only); gpu_worker.py `wake_up` restores named buffers only, and LoRA buffers are plain tensor
    attributes. The sync then writes the adapter's A rows and scaled B, but not A's rows past the trainer's
    rank, nor the part of a packed layer the adapter leaves out (k of qkv_proj for q_proj,v_proj): those would
    compute with whatever the pages held (a NaN there poisons every output, even times B's zero columns).
    vLLM re-writes a slot only when it activates an adapter (`set_lora` -> `reset_lora`), and ours stays active;
    its token-to-slot metadata only when the batch's mapping differs from the last (model_manager.py
    `set_adapter_mapping`, `_last_mapping`). So: each wrapped layer's own `reset_lora` for every slot, and the
    mapping cache forgotten. In-place writes: the buffers keep their identity (CUDA graphs and the in-place sync's
    arena hold them)."""
    adapters = _adapter_manager(worker)
    with torch.no_grad():
        for module in adapters.modules.values():
            for slot in range(adapters.lora_slots):
                module.reset_lora(slot)
    adapters._last_mapping = None
    adapters._last_slot_layout = None


def experts_carry_no_lora() -> None:
    """A LoRA job's MoE experts keep the kernel they have without LoRA. vLLM 0.32 picks the unquantized experts'
    kernel for "LoRA enabled" whenever the engine has LoRA at all (fused_moe/layer.py: `is_lora_enabled=
    vllm_config.lora_config is not None`), and then returns Triton (or FlashInfer's TRT-LLM on Blackwell) before
    it reads `moe_backend` (fused_moe/oracle/unquantized.py `select_unquantized_moe_backend`): on the CPU that is a
    kernel the CPU build lacks (seen: "triton.language has no attribute bfloat16" at the first generation), and on
    CUDA a choice that bypasses the Triton layout the sync writes (engine/actor.py `moe_backend`). colocate never
    wraps the experts (lora_target_modules names linear projections only, `adapter_targets`), so for them LoRA is
    not enabled: their method is built with a config that says so (fused_moe/unquantized_fused_moe_method.py
    `UnquantizedFusedMoEMethod.__init__`). Imported once per worker process (engine/extension.py)."""
    import dataclasses

    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    init = UnquantizedFusedMoEMethod.__init__
    if getattr(init, "colocate_patched", False):
        return

    def without_lora(self, moe):
        init(self, dataclasses.replace(moe, is_lora_enabled=False) if moe.is_lora_enabled else moe)

    without_lora.colocate_patched = True
    UnquantizedFusedMoEMethod.__init__ = without_lora


def engine_tensors(worker) -> dict[str, torch.Tensor]:
    """What the sync writes and verification reads in this worker, by name: its parameters under their unwrapped
    names, and in a LoRA job the adapter's buffers."""
    tensors = {base_name(n): p for n, p in worker.model_runner.model.named_parameters()}
    if getattr(worker.model_runner, "lora_manager", None) is not None:
        tensors.update(adapter_views(worker))
    return tensors


def shape_2d(name: str, tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape the sync plans a tensor by: an adapter buffer's [1, 1, rows, cols] is its slot's [rows, cols]."""
    return tuple(tensor.shape[2:]) if is_adapter(name) else tuple(tensor.shape)


def base_name(name: str) -> str:
    """An engine parameter's name as it was before vLLM wrapped its layer for LoRA (`qkv_proj.base_layer.weight`
    -> `qkv_proj.weight`): the sync's reshard rules and the trainer's names know the unwrapped one."""
    return name.replace(".base_layer.", ".")
