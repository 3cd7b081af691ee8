"""The learning rate of each optimizer step (trainer.lr_schedule): linear warmup, then constant, cosine or linear
decay to trainer.lr_min_ratio x trainer.lr at the run's last step.

    lr = learning_rate(step * k + update, cfg.trainer, num_steps=cfg.algo.num_steps * k)   # k: algo.num_updates

A function of the optimizer step's index alone (the RL step, restored with a checkpoint's data place, times the
optimizer steps a step, plus the update within it: trainer/actor.py train_step): a resumed run takes
exactly the learning rates the uninterrupted one would have, with no scheduler state to keep in step, and the
decay reaches its floor at the run's last step even when a step trained nothing (dynamic sampling found no
informative group) and took no optimizer step.
"""

from __future__ import annotations

import math

from colocate.config import TrainerConfig


def learning_rate(step: int, cfg: TrainerConfig, *, num_steps: int) -> float:
    """Warmup: step s < W uses (s + 1) / (W + 1) x lr (never 0, so the first step learns). After it, the decay's
    progress runs from 0 at step W to 1 at the last step, num_steps - 1."""
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return cfg.lr * (step + 1) / (warmup + 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, num_steps - 1 - warmup))
    floor = cfg.lr_min_ratio
    if cfg.lr_schedule == "linear":
        return cfg.lr * (1 - (1 - floor) * progress)
    assert cfg.lr_schedule == "cosine", cfg.lr_schedule
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
