"""FSDP2 sharding of a Hugging Face model, one decoder layer at a time, without the device ever holding it whole.

    shard_by_layer(model, mesh=mesh, device=device, offloader=offloader, mp_policy=policy)

The checkpoint loads on the CPU and goes to the device one block at a time, each sharded before the next moves.
Hazard (torch_memory_saver): each block moves *outside* the offloader's region and is sharded inside it, so only
the shards are the region's: the package pauses what is allocated in the region, and its pool's freed blocks stay
reserved, so the full block must not come from it.
"""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks to shard one by one: the classes the model declares unsplittable (`_no_split_modules`, what
    Hugging Face's own FSDP wrapping uses), e.g. Qwen2DecoderLayer, LlamaDecoderLayer, GPT2Block."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    assert layers, f"{type(model).__name__} declares no decoder layer class (_no_split_modules)"
    return layers


def checkpoint_layers(model: torch.nn.Module, *, offload: bool = False) -> None:
    """Recompute every decoder layer in the backward, keeping only its input (Hugging Face's
    GradientCheckpointingLayer, with torch's non-reentrant checkpoint). Before fully_shard; the parameters keep
    their names (a checkpoint_wrapper would prefix them, and the sync and checkpoints go by name).

    How it composes with FSDP2: the layer's __call__ runs the checkpoint around the module call, FSDP2's hooks
    included. In the backward the layer's pre-backward hook unshards it, then the recompute runs the module's
    forward hooks again in state PRE_BACKWARD, where FSDP2's pre-forward does not unshard and its post-forward
    does not reshard: "When composing with module-hook-based activation checkpointing, the pre-backward hook is
    responsible for the unshard" (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, FSDPState._pre_forward
    and _post_forward). `offload`: the kept inputs live in pinned host memory (torch.autograd.graph.save_on_cpu)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"trainer.activation_checkpointing=true is invalid: {type(model).__name__} cannot "
                         "checkpoint its layers (transformers' supports_gradient_checkpointing is False)")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=offload)


def shard_by_layer(model: torch.nn.Module, *, mesh, device: torch.device, offloader, mp_policy,
                   **fully_shard_kwargs) -> None:
    """fully_shard every decoder layer; untied, the input embeddings and lm_head each as a group of their own;
    then the root (what no group holds: the final norm, and tied embeddings with lm_head).

    Why the untied head and embeddings are groups of their own (torchtitan shards its tok_embeddings and output
    the same way): FSDP2 keeps the root's parameters unsharded from the forward to the end of the backward
    (torch/distributed/fsdp/_fully_shard/_fsdp_state.py `_lazy_init`: the root's post-forward mesh is None), with
    its full gradients until its reduce-scatter at the very end. As the root, embeddings plus lm_head are two
    vocab x hidden matrices, gradients and a flat fp32 reduce buffer alive at the step's peak (0.4 GB of the
    bench preset's 1.3 GB fixed step memory). As groups: the embeddings reshard after their forward, and lm_head,
    unsharded from its forward to its backward (reshard_after_forward=False: the backward starts with it, as
    torchtitan keeps its last group), reduce-scatters and reshards before the decoder's backward. Tied, one
    Parameter is both, and one group must hold it: the root."""
    from torch.distributed.fsdp import fully_shard

    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = head is not None and embeddings is not None and head.weight is not embeddings.weight
    groups = [(block, fully_shard_kwargs) for block in decoder_layers(model)]
    if untied:
        groups += [(embeddings, fully_shard_kwargs),
                   (head, {"reshard_after_forward": False, **fully_shard_kwargs})]
    for block, kwargs in [*groups, (model, fully_shard_kwargs)]:
        move_unsharded(block, device)
        with offloader.allocation_region():
            fully_shard(block, mesh=mesh, mp_policy=mp_policy, **kwargs)


def move_unsharded(module: torch.nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers of `module` that FSDP2 has not sharded yet to `device`, in place
    (`.data`: the same Parameter objects, so tied weights stay tied), as fully_shard's own move does."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in module.parameters():
            if not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and buffer.device != device:
                    sub._buffers[name] = buffer.to(device)
