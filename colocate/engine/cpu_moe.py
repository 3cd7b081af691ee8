"""Routed experts on vLLM's CPU backend, computed on the weights where vLLM loaded them.

Why colocate replaces the CPU expert kernel (vLLM 0.32, `model_executor/layers/fused_moe/experts/cpu_moe.py`):

- `CPUUnquantizedExperts.process_weights_after_loading` pads the intermediate dimension to 32 and repacks
  `w13_weight` / `w2_weight` into the kernel's blocked layout (`cpu_prepack_moe_weight`), same shape, other
  order. The sync writes, and verification reads, the loaded layout: after a sync the kernel would compute with
  bytes in the wrong order. (Seen here: expert 0's gate rows no longer match the checkpoint after loading.)
- Its `apply` ignores `expert_map`: under expert parallelism it is handed global expert ids for a worker that holds
  a block of them, and the kernel reads past its weights (seen here: a segfault in `cpu_fused_moe.cpp` on the
  first generation with `enable_expert_parallel=True`, TP=2).

So on the CPU (and only there: this module is imported by the worker extension's CPU patches) the experts keep the
loaded layout and `apply` runs the experts in torch: per local expert, its tokens' `act(x W_gate^T) * (x W_up^T)
W_down^T`, weighted and summed. Everything around it stays vLLM's: routing (the CPU router), the expert map,
weight loading and the TP/EP reductions. This is the experts' counterpart of the extension's plain `F.linear`
(engine/extension.py), with the same cost: vLLM's packed CPU kernel. On CUDA the unquantized Triton experts keep
the loaded layout and honour the expert map, and nothing here runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def plain_fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str = "silu",
                        expert_map: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None, weights_applied: bool = False) -> torch.Tensor:
    """The routed experts' output [M, K] for tokens `hidden_states` [M, K].

    w13 [E_local, 2N, K] (per expert [gate | up]), w2 [E_local, K, N]; topk_ids [M, top_k] global expert ids,
    mapped to local slots by `expert_map` (global -> local, -1 where another worker holds the expert: that
    worker adds its share in the EP reduction). `weights_applied`: vLLM already scaled the input by the router
    weight (apply_router_weight_on_input), so the outputs are summed unweighted."""
    if activation not in _ACTIVATIONS:
        raise NotImplementedError(f"colocate's CPU experts support {sorted(_ACTIVATIONS)}, not {activation!r}")
    act = _ACTIVATIONS[activation]
    slots = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()]
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    for slot in slots[slots >= 0].unique().tolist():
        token, choice = (slots == slot).nonzero(as_tuple=True)
        h = F.linear(hidden_states[token], w13[slot], None if w13_bias is None else w13_bias[slot])
        gate, up = h.chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w2[slot], None if w2_bias is None else w2_bias[slot]).float()
        if not weights_applied:
            y = y * topk_weights[token, choice, None].float()
        out.index_add_(0, token, y)
    return out.to(hidden_states.dtype)


def use_plain_cpu_experts() -> None:
    """Patch vLLM's CPU unquantized experts (every ISA subclass inherits these two methods) as the module says."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    def keep_loaded_layout(self, layer: torch.nn.Module) -> None:
        self._use_zentorch = False

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        output.copy_(plain_fused_experts(
            hidden_states, w1, w2, topk_weights, topk_ids, activation=activation.value, expert_map=expert_map,
            w13_bias=self.w1_bias, w2_bias=self.w2_bias, weights_applied=apply_router_weight_on_input))

    CPUUnquantizedExperts.process_weights_after_loading = keep_loaded_layout
    CPUUnquantizedExperts.apply = apply
