"""The frozen reference policy of the KL penalty (`algo.kl_coef > 0`): the initial weights, sharded like the policy
and kept offloaded except while it scores a train step's micro-batches.

    reference = ReferencePolicy(model_path, mesh=mesh, device=device, cfg=trainer_cfg)   # built offloaded
    ref_logprobs = reference.score(batches, temperature=t, top_p=p)   # onload, one forward per batch, offload

It is the checkpoint at `model_path` loaded and sharded exactly as TrainerActor.setup shards the policy (each
decoder layer, then the root, with `fully_shard` on the same mesh and the same mixed-precision policy), with no
gradients and in eval mode, and its logprobs come from the same `token_logprobs`: while the policy still holds the
initial weights the two compute the same logprobs and the KL is exactly 0.

Memory: one more sharded copy of the weights, stored in the dtype the policy computes in (fp32, or bf16 under
trainer.mixed_precision: FSDP2 casts the policy's fp32 shards to bf16 before its all-gather, so a bf16 reference
computes the very same values at half the bytes). It has its own offloader (its own file, pinned buffer or
torch_memory_saver tag): between uses the device holds none of it, and it is resident only for the reference
forwards at the start of a train step, before the policy's activations and gradients exist.
Hazard: each forward is a set of FSDP2 collectives: every rank must score the same number of batches.

A LoRA job's reference is its base (BaseReference): the policy's model with the adapters switched off, no copy.
"""

from __future__ import annotations

import torch

from colocate.trainer.batching import MicroBatch, attention_implementation
from colocate.trainer.fsdp import shard_by_layer
from colocate.trainer.logprobs import install_chunked_head, sequence_logprobs
from colocate.trainer.offload import make_offloader

REFERENCE_TAG = "colocate-reference"  # torch_memory_saver pauses by tag: not the policy's


class ReferencePolicy:
    def __init__(self, model_path: str, *, mesh, device: torch.device, cfg):
        """`cfg`: the TrainerConfig (mixed_precision, offload_backend, offload_dir). A collective (sharding):
        every rank builds it. Returns offloaded."""
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     attn_implementation=attention_implementation(cfg, device.type))
        if cfg.logprob_chunk_tokens:
            install_chunked_head(model, cfg.logprob_chunk_tokens, fp32_logits=cfg.fp32_lm_head)
        model.requires_grad_(False)
        model.eval()  # no dropout: the policy's logprobs at the initial weights must match these exactly
        if cfg.mixed_precision:
            # parameters only (`.data`: tied weights stay tied); fp32 buffers (rotary frequencies) stay fp32 as
            # in the policy
            for param in model.parameters():
                param.data = param.data.to(torch.bfloat16)
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if cfg.mixed_precision \
            else MixedPrecisionPolicy()
        self._offloader = make_offloader(device, backend=cfg.offload_backend, directory=cfg.offload_dir or None,
                                         tag=REFERENCE_TAG, owner=f"trainer rank {mesh.get_rank()} (reference policy)")
        # As in TrainerActor.setup: each full block moves outside the offloader's region, only its shards are in it.
        # reshard_after_forward=True, the root's too: by default FSDP2 keeps the root's gathered parameters
        # (embeddings, lm_head: the largest) after the forward for the backward to use, and this model has no
        # backward: they would stay resident, full size, beside the policy (and offload() would find plain,
        # unsharded parameters where it expects DTensors).
        shard_by_layer(model, mesh=mesh, device=device, offloader=self._offloader, mp_policy=mp_policy,
                       reshard_after_forward=True)
        self.model = model
        self.local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        self._offloaded = False
        self.offload()

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    @torch.no_grad()
    def logprobs(self, batch: MicroBatch, *, temperature: float, top_p: float) -> torch.Tensor:
        """[B, T-1] logprob of each next token under the reference, as the policy's (trainer/logprobs.py). A
        collective; the reference must be onloaded."""
        assert not self._offloaded, "the reference is offloaded: onload() it first (its storages are empty)"
        return sequence_logprobs(self.model, batch, temperature=temperature, top_p=top_p)[0]

    def score(self, batches: list[MicroBatch], *, temperature: float, top_p: float) -> list[torch.Tensor]:
        """The reference logprobs of every batch, onloaded for just these forwards and offloaded again (a
        collective: every rank passes the same number of batches, padding included)."""
        self.onload()
        try:
            return [self.logprobs(b, temperature=temperature, top_p=top_p) for b in batches]
        finally:
            self.offload()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All-gathered full parameters, copied to the CPU (a collective; for verification)."""
        offloaded = self._offloaded
        self.onload()
        # copy=True: with one rank, full_tensor() is a view of the live shard, which offload() releases
        state = {name: p.full_tensor().detach().to("cpu", copy=True) for name, p in self.model.named_parameters()}
        if offloaded:
            self.offload()
        return state

    def offload(self) -> int:
        if self._offloaded:
            return 0
        self._offloaded = True
        return self._offloader.offload([p.to_local() for p in self.model.parameters()])

    def onload(self) -> int:
        if not self._offloaded:
            return 0
        self._offloaded = False
        return self._offloader.onload()

    def close(self) -> None:
        self._offloader.close()


class BaseReference:
    """A LoRA job's reference policy: the policy's own model with its adapters switched off, which is the frozen
    base, exactly (the base never trains: trainer/lora.py). No second copy to build, hold or move; its forwards
    are the policy's own FSDP2 collectives, so every rank must score the same number of batches here too."""

    local_bytes = 0  # holds nothing of its own

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def score(self, batches: list[MicroBatch], *, temperature: float, top_p: float) -> list[torch.Tensor]:
        from colocate.trainer.lora import adapters_disabled

        with adapters_disabled(self.model):
            return [sequence_logprobs(self.model, b, temperature=temperature, top_p=top_p)[0] for b in batches]
