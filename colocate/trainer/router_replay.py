"""Router replay (algo.router_replay, R3): the trainer's MoE layers send each token to the experts the engine sent
it to, so a token whose router scores lie close is not routed one way in the rollout and another in training.

    replay = RouterReplay(model)                  # before sharding: one per model, patches every router
    replay.set(batch.routing)                     # [rows, T, layers, top_k] long, -1: route freely
    out = model(**batch.model_inputs())           # ... and its backward, under the same rows
    replay.set(None)

What is replayed is the choice of experts, not their weights: each token's weights are the trainer's own router
probabilities at the replayed experts (renormalised as the model does), so the router still learns from the loss,
as Megatron's and verl's R3 do. A position without a row (-1: the last token of a sequence, padding, what the
engine did not run) routes as the model would.

The rows stay set until the next `set`: activation checkpointing runs a layer's forward again in the backward
(trainer/fsdp.py), and the recomputation must route as the forward did.

Written for transformers' Qwen3-MoE router (`Qwen3MoeTopKRouter.forward`, transformers 5.19
`models/qwen3_moe/modeling_qwen3_moe.py`: softmax in fp32, top-k, optional renormalisation), which is what the MoE
presets are; the replayed forward below is that one with the indices given. Another router is refused.
"""

from __future__ import annotations

import re
import types

import torch
import torch.nn.functional as F

ROUTERS = ("Qwen3MoeTopKRouter",)


def _replayed_forward(self, hidden_states: torch.Tensor):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    top_value, indices = torch.topk(router_probs, self.top_k, dim=-1)
    replay, own = self.colocate_replay, indices
    if replay is not None:
        assert replay.shape == indices.shape, f"replay rows {tuple(replay.shape)} for {tuple(indices.shape)} tokens"
        indices = torch.where(replay >= 0, replay, indices)
        top_value = router_probs.gather(-1, indices)
        # the tokens this router would have sent elsewhere (as a set: the order of two experts changes nothing)
        self.colocate_flipped = (own.sort(-1).values != indices.sort(-1).values).any(-1).detach()
    if self.colocate_record is not None:  # for the bench and the tests: the router's own choice, and the one used
        self.colocate_record.append((own.detach(), indices.detach()))
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), indices


class RouterReplay:
    def __init__(self, model: torch.nn.Module) -> None:
        routers: dict[int, torch.nn.Module] = {}
        for name, module in model.named_modules():
            if not name.endswith("router") and not name.endswith("gate"):
                continue
            kind = type(module).__name__
            if kind.endswith("Router") and kind not in ROUTERS:
                raise ValueError(f"algo.router_replay: colocate replays {', '.join(ROUTERS)}, not {kind} ({name})")
            if kind in ROUTERS:
                routers[int(re.search(r"layers\.(\d+)\.", name).group(1))] = module
        assert routers, "router replay on a model without routers (the job's checks refuse a dense model)"
        self.routers = dict(sorted(routers.items()))
        self.num_layers = model.config.num_hidden_layers
        self.top_k = next(iter(self.routers.values())).top_k
        for router in self.routers.values():
            router.colocate_replay, router.colocate_record, router.colocate_flipped = None, None, None
            router.forward = types.MethodType(_replayed_forward, router)

    def set(self, routing: torch.Tensor | None) -> None:
        """Replay `routing` ([rows, T, layers, top_k], -1 where free) in every forward until the next set;
        None: every router chooses."""
        for layer, router in self.routers.items():
            router.colocate_replay = None if routing is None else routing[:, :, layer].reshape(-1, self.top_k)
            router.colocate_flipped = None

    def flipped(self, rows: int, width: int) -> torch.Tensor:
        """[rows, width] bool: the positions whose experts the last replayed forward took from the engine against
        the trainer's own choice, in any layer (the routing flips R3 removes)."""
        out = torch.zeros(rows * width, dtype=torch.bool)
        for router in self.routers.values():
            if router.colocate_flipped is not None:
                out = out.to(router.colocate_flipped.device) | router.colocate_flipped
        return out.reshape(rows, width)

    def record(self, on: bool) -> None:
        """Keep each router's choices (its own, and the one used) from now on (on), or stop (off)."""
        for router in self.routers.values():
            router.colocate_record = [] if on else None

    def recorded(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last forward's choices, each [rows, width, layers, top_k] (-1 in a layer without a router): the
        routers' own, and the ones the forward used (the replayed rows where it had them)."""
        first = next(iter(self.routers.values())).colocate_record[-1][0]
        own, used = (torch.full((rows, width, self.num_layers, self.top_k), -1, dtype=first.dtype,
                                device=first.device) for _ in range(2))
        for layer, router in self.routers.items():
            own[:, :, layer], used[:, :, layer] = (t.reshape(rows, width, self.top_k)
                                                   for t in router.colocate_record[-1])
            router.colocate_record = []
        return own, used
