"""What an engine worker holds of a MoE model's routed experts, read from vLLM's own layers (not assumed).

vLLM 0.32 places experts by its expert map (`FusedMoE.expert_map`: global id -> local slot, -1 for experts another
worker holds; a contiguous block per worker by default, round-robin on request) and splits each expert's
intermediate dimension by the MoE layer's own TP (`moe_config.moe_parallel_config`: the engine's TP without
expert parallelism, 1 with it). The reshard plan takes both from this report, so a placement vLLM chooses
differently (a new default, round-robin) is followed rather than broken.

    expert_report(model)  # {"tp_rank": 1, "tp_size": 2, "expert_ids": [0, ..., 7]} or None for a dense model
"""

from __future__ import annotations

import torch


def expert_report(model: torch.nn.Module) -> dict | None:
    """The experts' layout every MoE layer of `model` shares, None for a dense model or when layers differ (load
    balancing that moves experts per layer: no rule, the full-tensor path loads them)."""
    reports = []
    for module in model.modules():
        if not hasattr(module, "w13_weight") or not hasattr(module, "moe_config"):
            continue
        parallel = module.moe_config.moe_parallel_config
        num_experts = module.global_num_experts
        expert_map = module.expert_map
        if expert_map is None:
            ids = list(range(num_experts))
        else:
            slots = expert_map.tolist()
            ids = sorted((slot, expert) for expert, slot in enumerate(slots) if slot >= 0)
            ids = [expert for _, expert in ids]
        reports.append({"tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size, "expert_ids": ids})
    if not reports or any(r != reports[0] for r in reports):
        return None
    return reports[0]
