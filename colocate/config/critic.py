"""The `critic` section: the value model of algo.advantage=gae (PPO with a critic, Schulman et al. 2017), trained
beside the policy on the same trainer ranks with its own optimizer.

    critic.model_path=policy      a copy of the policy's checkpoint, its LM head replaced by a scalar head
    critic.model_path=/models/vm  a model of its own (a causal LM checkpoint with the policy's vocabulary)

The critic lives in the trainer's processes (trainer/critic.py), sharded on the same FSDP2 mesh and offloaded with
the policy's state while the engines run, as verl colocates its actor and critic in one worker. The checks of one
key sit here; those across sections are JobConfig.check's, and whether the path is a usable model is
job/checks.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.config.fields import bad, non_negative, positive

POLICY = "policy"


@dataclass
class CriticConfig:
    model_path: str = ""
    """The value model, needed by algo.advantage=gae and refused without it: policy (a copy of the policy's checkpoint
    whose LM head becomes a scalar value head, initialised to 0), or the path of a causal LM of its own with the
    policy's vocabulary (its head replaced the same way; a checkpoint that carries a value head, score.weight or
    v_head.weight, keeps it and must match its hidden size). Empty: no critic."""
    lr: float = 1e-3
    """The critic's peak learning rate, following trainer.lr_schedule and trainer.lr_warmup_steps in optimizer steps as
    the policy's does. The default is trainer.lr's, sized for the embedded tiny model; a real model's recipe sets both
    (verl's critic default is 1e-5, ten times its actor's)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    grad_clip: float = 1.0
    """Clip the critic's gradient to this total norm; 0: no clipping."""
    value_clip: float = 0.5
    """PPO's value clipping: the loss is the larger of (V - R)^2 and (clip(V, V_old - c, V_old + c) - R)^2, with V_old
    the critic's values before the step's first update (verl's cliprange_value); 0: no clipping."""

    @property
    def enabled(self) -> bool:
        return bool(self.model_path)

    def check(self) -> None:
        positive(self, "critic", "lr")
        non_negative(self, "critic", "weight_decay", "grad_clip", "value_clip")
        if self.model_path and self.model_path != POLICY and self.model_path.strip() != self.model_path:
            raise bad("critic.model_path", self.model_path, "has surrounding spaces; valid: policy, or a path")


def resolved_critic(critic: CriticConfig) -> CriticConfig:
    """The section as the trainer actors read it: a path made absolute (an actor's working directory is not the
    launcher's); `policy` and empty as they are."""
    import dataclasses
    from pathlib import Path

    if not critic.model_path or critic.model_path == POLICY:
        return critic
    return dataclasses.replace(critic, model_path=str(Path(critic.model_path).expanduser().resolve()))
