"""LoRA on the trainer's linear layers: the base frozen, two small matrices per targeted layer trained.

    targets = lora_targets(model, ["q_proj", "v_proj"])   # or ["all-linear"]; names of the layers to adapt
    add_lora(model, targets, rank=8, alpha=16, seed=0)     # before sharding: every rank makes the same A

A targeted nn.Linear becomes a LoRALinear. Its base weight and bias stay the very Parameters they were, under the
same names, frozen: the base checkpoint loads as before, and the engine's base weights never change. Beside them,
`lora_A.weight` [rank, in] and `lora_B.weight` [out, rank], PEFT's names, shapes and initialisation:

    y = x W^T + b + scaling * (x A^T) B^T,    scaling = alpha / rank,   A ~ kaiming-uniform(a=sqrt(5)),  B = 0

so step 0's policy is exactly the base model. The names are PEFT's (`...q_proj.lora_A.weight`, without PEFT's
`base_model.model.` prefix and adapter name), so an export is a rename, and vLLM's own adapter loader reads them.

Which layers: the attention and MLP projections a vLLM engine can carry an adapter on (LORA_TARGETS), by
PEFT's rule: a target names the last component(s) of a module's name. "all-linear" is every one of them the
model has. A MoE model's experts are fused tensors, not nn.Linear: targets there are the attention's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from colocate.config.schema import ALL_LINEAR, LORA_TARGETS


class LoRALinear(nn.Linear):
    """nn.Linear with a low-rank update. Subclassing keeps `isinstance(m, nn.Linear)` true for code that asks."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: names and storage unchanged
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.scaling = rank, alpha / rank
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, dtype=torch.float32)
        with torch.no_grad():  # PEFT's init_lora_weights=True, from a generator every rank seeds alike
            bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix
            self.lora_A.weight.uniform_(-bound, bound, generator=generator)
            self.lora_B.weight.zero_()
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).to(out.dtype) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling}"


def lora_targets(model: nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """target -> the names of the model's nn.Linear modules it selects (PEFT's suffix rule), for every target
    given; "all-linear" selects every projection in LORA_TARGETS the model has. A target selecting nothing
    maps to [] (the caller's error names it)."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    out = {}
    for target in targets:
        if target == ALL_LINEAR:
            out[target] = [n for n in linear if n.rsplit(".", 1)[-1] in LORA_TARGETS]
        else:
            out[target] = [n for n in linear if n == target or n.endswith("." + target)]
    return out


def add_lora(model: nn.Module, names: list[str], *, rank: int, alpha: float, seed: int) -> int:
    """Replace the named nn.Linear modules with LoRALinear, freeze every other parameter, and return the number
    of trainable parameters. Seeded per call, in model order: every rank builds bit-equal adapters before
    FSDP2 shards them (a rank's shard is cut from its own full copy)."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.requires_grad_(False)
    chosen = set(names)
    for name in [n for n, _ in model.named_modules() if n in chosen]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, generator))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


class adapters_disabled:
    """Within it the model computes as its frozen base (the reference policy of a LoRA job: no second copy)."""

    def __init__(self, model: nn.Module):
        self.modules = list(lora_modules(model).values())

    def __enter__(self):
        for m in self.modules:
            m.enabled = False

    def __exit__(self, *exc):
        for m in self.modules:
            m.enabled = True


class ScaledB:
    """What the engine receives for each adapter's B: scaling x B, zero-padded to the engine's rank (vLLM computes
    with its B already scaled, see engine/lora.py), as DTensors sharded exactly like the B they mirror, so the
    sync reads them like any parameter (sync/shards.py). Refreshed after every optimizer step and checkpoint load:
    between refreshes they are stale. A few MB for a rank-8 adapter on a 7B model.

    Hazard (offload): they stay where they are when the trainer offloads (the sync reads them, and they are small);
    `refresh` reads the live B, so call it only while the state is on the device."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor], engine_rank: int):
        from torch.distributed.tensor import DTensor

        self.pairs = []  # (live B, its module's scaling, the padded shadow's local rows)
        self.tensors: dict[str, torch.Tensor] = {}
        scaling = {f"{name}.lora_B.weight": m.scaling for name, m in lora_modules(model).items()}
        for name, param in params.items():
            if name not in scaling:
                continue
            assert isinstance(param, DTensor), name
            local = param.to_local()
            shadow = torch.zeros(local.shape[0], engine_rank, dtype=local.dtype, device=local.device)
            self.tensors[name] = DTensor.from_local(shadow, param.device_mesh, param.placements,
                                                    shape=torch.Size((param.shape[0], engine_rank)),
                                                    stride=(engine_rank, 1), run_check=False)
            self.pairs.append((param, scaling[name], shadow))
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        for param, scaling, shadow in self.pairs:
            local = param.to_local()
            torch.mul(local, scaling, out=shadow[:, :local.shape[1]])
