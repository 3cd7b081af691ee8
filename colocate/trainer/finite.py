"""NaN/Inf guards around the optimizer step: a non-finite gradient or weight stops the step with the parameter's
name, on every rank at once, before anything reaches the engine.

    grad_norm = clip_checked(params, max_norm, step=step, rank=rank)   # raises NonFiniteError; the step is skipped
    optimizer.step()
    check_weights(params, step=step, rank=rank)                        # raises NonFiniteError (e.g. lr too high)

    grad_norm = guarded_step(optimizer, params, max_norm=m, lr=lr, step=s, rank=r, create_state=f)  # all of it

Agreement: every rank must raise, or none. A rank that raised alone would leave the others waiting in the next
collective (the next step's FSDP all-gather, or the sync's gather) until the process-group timeout. So each
decision is taken on a value every rank holds identically after a collective: the all-reduced total gradient
norm (clipping computes it anyway), or an all-reduced per-parameter code vector (`_agreed_codes`), never on a
rank's local view alone.

Cost: with `trainer.grad_clip > 0` the gradient check is the clip's own total norm, nothing more; without
clipping one fused norm over the local gradient shards and one all-reduce of one int64 per parameter. After the
step, one fused norm over the local weight shards and the same small all-reduce. Names are looked up only when
something is wrong.

Hazard (overflow): a 2-norm of finite values beyond ~1e19 overflows fp32 to inf, so a non-finite norm only
nominates a tensor; `torch.isfinite` on the nominated ones decides. (The inf-norm cannot overflow, but whether
its CUDA kernel propagates NaN is a kernel detail; a sum of squares always does.)
"""

from __future__ import annotations

import math

import torch

from colocate.errors import NonFiniteError


def guarded_step(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor], *, max_norm: float, lr: float,
                 step: int, rank: int, create_state) -> float | None:
    """One optimizer step between the guards: clip (every rank raising together on a non-finite gradient), create
    the optimizer's state where it has none yet (`create_state()`: in the offloader's region), set `lr`, step, and
    check the weights. The policy's step and the critic's (trainer/actor.py, trainer/critic.py). Returns the
    total gradient norm before clipping (None without clipping)."""
    grad_norm = clip_checked(params, max_norm, step=step, rank=rank)
    if not optimizer.state:
        create_state()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    check_weights(params, step=step, rank=rank)
    return grad_norm


def clip_checked(params: dict[str, torch.Tensor], max_norm: float, *, step: int, rank: int) -> float | None:
    """Check every gradient is finite (a collective), then clip them to `max_norm` (0: no clipping). Returns the
    total gradient norm when clipping, else None. Raises NonFiniteError on every rank, before anything changed."""
    grads = {name: p.grad for name, p in params.items() if p.grad is not None}
    total = None
    if max_norm > 0:
        norm = torch.nn.utils.get_total_norm(list(grads.values()))
        total = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # all-reduced: one value
        if math.isfinite(total):
            torch.nn.utils.clip_grads_with_norm_(list(params.values()), max_norm, norm)
            return total
    # every rank is here together: no clipping, or the same non-finite total norm on all of them
    bad = _agreed_codes(grads, rank)
    if bad:
        raise NonFiniteError(f"training step {step}: {_describe(bad, 'gradient of ')}; the optimizer step was "
                             "skipped, the engine keeps the previous weights")
    if total is not None:
        raise NonFiniteError(f"training step {step}: the total gradient norm overflowed to {total} though every "
                             "gradient is finite (gradients beyond ~1e19); the optimizer step was skipped, the "
                             "engine keeps the previous weights")
    return None


def check_weights(params: dict[str, torch.Tensor], *, step: int, rank: int) -> None:
    """After the optimizer step: every weight shard is finite (a collective). Raises NonFiniteError on every rank."""
    bad = _agreed_codes(params, rank)
    if bad:
        raise NonFiniteError(f"training step {step}: {_describe(bad, '')} after the optimizer step (every "
                             "gradient was finite: a learning rate too high?); the engine keeps the previous "
                             "weights, the trainer's are lost: resume from a checkpoint")


def _agreed_codes(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, int]:
    """name -> code of every tensor holding a NaN or Inf on some rank, the same on every rank (an all-reduce).
    A code is 2 * (rank + 1) + (1 for NaN, 0 for Inf only): MAX keeps the highest rank that has one."""
    import torch.distributed as dist

    names = list(tensors)
    local = [_local(tensors[n]) for n in names]
    device = local[0].device if local else torch.device("cpu")
    codes = torch.zeros(len(names), dtype=torch.int64, device=device)
    present = [i for i, t in enumerate(local) if t.numel()]  # a rank may hold no rows of a tensor
    if present:
        norms = torch.stack([n.float() for n in torch._foreach_norm([local[i] for i in present])]).cpu()
        for k in (~torch.isfinite(norms)).nonzero().flatten().tolist():
            t = local[present[k]]
            if not bool(torch.isfinite(t).all()):  # not merely an overflowing norm (module hazard)
                codes[present[k]] = 2 * (rank + 1) + int(bool(torch.isnan(t).any()))
    if dist.is_initialized():
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)
    return {names[i]: code for i, code in enumerate(codes.tolist()) if code}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _describe(bad: dict[str, int], prefix: str) -> str:
    name, code = next(iter(bad.items()))  # model order: the first one the forward pass meets
    text = f"{prefix}{name} is {'NaN' if code % 2 else 'Inf'} on rank {code // 2 - 1}"
    if len(bad) > 1:
        text += f" (and {len(bad) - 1} more parameter(s), e.g. {list(bad)[1]})"
    return text
