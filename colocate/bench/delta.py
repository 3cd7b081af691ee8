"""`colocate bench delta`: how much of a full fine-tune's weights change from one sync to the next, in the engine's
dtype, and what each encoding of the change would send (sync/delta.py). The measurement that decides whether
sending only what changed pays: PULSE (Miahi and Belilovsky 2026) finds about 99% of bf16 weights bit-identical
step to step at RL learning rates, TRL's delta sync at least 98%.

    colocate bench delta                                        # the default job, its learning rate
    colocate bench delta model.preset=bench trainer.lr=1e-6     # the bench preset at the 7B recipe's rate

The job runs real steps (rollout, score, train, sync), and after each the trainers' weights are gathered in the
engine's dtype (TrainerActor.full_state_dict, as the sync casts them) and compared with the previous step's bit
for bit. Per step and per tensor kind (embeddings, attention, MLP, experts, norms, lm_head): the share of elements
that changed, and the bytes each encoding sends against the full weights: 4-byte indices with the elements,
delta-coded positions with the elements (sync/delta.py), and the same compressed with zlib where that is
smaller; and the encode time. Writes JSON.
"""

from __future__ import annotations

import re
import time

import ray
import torch

from colocate.bench.common import write_result
from colocate.config import JobConfig
from colocate.job.controller import Controller
from colocate.job.runtime import Runtime
from colocate.sync.delta import encode

DELTA_DEFAULTS = ["logging.progress=false", "trainer.offload=false", "checkpoint.at_end=false"]
KINDS = (("embeddings", r"embed_tokens"), ("lm_head", r"lm_head"), ("norms", r"norm"),
         ("experts", r"experts"), ("router", r"mlp\.gate\.weight$"), ("attention", r"self_attn"),
         ("mlp", r"mlp\."))


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other")


def measure_step(previous: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> dict:
    """One sync's change: per kind and in total, the changed share and every encoding's bytes."""
    kinds: dict[str, dict] = {}
    started = time.perf_counter()
    for name, tensor in current.items():
        delta = encode(previous[name], tensor)
        row = kinds.setdefault(kind_of(name), {"numel": 0, "changed": 0, "full_bytes": 0, "index_bytes": 0,
                                               "gap_bytes": 0, "sent_bytes": 0})
        size = tensor.element_size()
        row["numel"] += tensor.numel()
        row["changed"] += delta.count
        row["full_bytes"] += tensor.numel() * size
        row["index_bytes"] += min(delta.count * (4 + size), tensor.numel() * size)
        uncompressed = delta if not delta.compressed else encode(previous[name], tensor, compress=False)
        row["gap_bytes"] += uncompressed.nbytes
        row["sent_bytes"] += delta.nbytes
    encode_s = time.perf_counter() - started
    total = {key: sum(k[key] for k in kinds.values()) for key in next(iter(kinds.values()))}
    for row in (*kinds.values(), total):
        row["density"] = row["changed"] / row["numel"]
        for key in ("index_bytes", "gap_bytes", "sent_bytes"):
            row[key.replace("bytes", "share")] = row[key] / row["full_bytes"]
    return {"total": total, "kinds": kinds, "encode_s": encode_s}


def run_delta_bench(cfg: JobConfig, *, num_steps: int, out_dir: str, name: str) -> dict:
    dtype = cfg.engine.dtype
    with Runtime(cfg) as rt:
        controller = Controller(cfg, rt)

        def weights() -> dict[str, torch.Tensor]:
            return next(s for s in ray.get([t.full_state_dict.remote(dtype, rank0_only=True) for t in rt.trainers])
                        if s is not None)

        previous, steps = weights(), []
        for step in range(num_steps):
            record = controller.step(step)
            current = weights()
            steps.append({"step": step, "lr": record["lr"], "reward_mean": record["reward_mean"],
                          **measure_step(previous, current)})
            previous = current
            t = steps[-1]["total"]
            print(f"step {step}: {t['density']:.2%} of {t['numel']:,} weights changed; sends "
                  f"{t['sent_share']:.2%} of the full bytes (indices {t['index_share']:.2%}, delta-coded "
                  f"{t['gap_share']:.2%}); encode {steps[-1]['encode_s']:.2f} s")
    result = {"config": {"model": cfg.model.preset or cfg.model.path, "lr": cfg.trainer.lr, "engine_dtype": dtype,
                         "mixed_precision": cfg.trainer.mixed_precision, "num_steps": num_steps},
              "steps": steps}
    path = write_result(result, out_dir, name)
    print(f"wrote {path}")
    return result
