"""The value model of algo.advantage=gae: a causal LM whose LM head is replaced by a scalar head, sharded like the
policy on the same trainer ranks, trained beside it with its own AdamW (critic.lr, critic.grad_clip).

    critic = Critic(path, mesh=mesh, device=device, cfg=trainer_cfg, critic=critic_cfg, offloader=offloader)
    values = critic.values(batch)                                  # [rows, T-1], no gradient
    loss, stats = critic.loss(batch, scale=mask / num_tokens)      # clipped value loss; backward by the caller
    grad_norm, lr = critic.step(step=3, update=0, num_updates=1, num_steps=150, rank=0)

Why in the trainer's processes and not a group of its own: co-located, every process on a device adds a CUDA
context and a copy of the framework, and the critic trains in the very phase the policy does. verl colocates its
actor, critic and reference in one worker for the same reason. It shares the policy's offloader (one region, one
pause): its parameters and AdamW moments leave the device with the policy's while the engines run, and come back
with them (TrainerActor._state_tensors), so the switch plan moves both in one go.

The value of response token t is the head's output at the position whose logits would predict t (the state before
t is emitted), the same target positions as the loss's log-probs (trainer/batching.py), so rl/gae.py's V_t and the
loss line up with no shift of their own.

The head starts at 0 (weight and bias): the first step's values are 0, its returns the rewards, and its gradient
reaches only the head; a random head would start the critic from noise the policy's advantages would carry. A
checkpoint that carries a value head (score.weight, v_head.weight, value_head.weight: TRL's and OpenRLHF's value
models) keeps it. The critic's gradient never reaches the policy: they share no parameter (a test holds it).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from colocate.trainer.batching import MicroBatch, attention_implementation
from colocate.trainer.finite import guarded_step
from colocate.trainer.fsdp import checkpoint_layers, shard_by_layer
from colocate.trainer.lr_schedule import learning_rate
from colocate.trainer.offload import create_optimizer_state
from colocate.trainer.stats import TrainStats

VALUE_HEADS = ("score", "v_head", "value_head")  # the names value models save their scalar head under


def saved_value_head(path: str | Path) -> tuple[str, tuple[int, ...]] | None:
    """(name, shape) of the value head a checkpoint carries, read from its safetensors headers alone; None: none."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for head in VALUE_HEADS:
                if f"{head}.weight" in f.keys():
                    return head, tuple(f.get_slice(f"{head}.weight").get_shape())
    return None


def value_model(path: str, *, attention: str) -> torch.nn.Module:
    """The causal LM at `path` with a [hidden -> 1] head in place of its LM head (fp32, as the policy loads)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    hidden = model.config.hidden_size
    head = torch.nn.Linear(hidden, 1, bias=True)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    saved = saved_value_head(path)
    if saved is not None:
        name, shape = saved
        assert shape == (1, hidden), f"{path}: {name}.weight {shape}, the model's hidden size {hidden} (job/checks.py)"
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key, target in ((f"{name}.weight", head.weight), (f"{name}.bias", head.bias)):
                    if key in f.keys():
                        target.data.copy_(f.get_tensor(key).to(torch.float32).reshape(target.shape))
    model.set_output_embeddings(head)
    model.config.tie_word_embeddings = False  # the embeddings stay; the head is its own
    return model


class Critic:
    def __init__(self, path: str, *, mesh, device: torch.device, cfg, critic, offloader):
        """`cfg`: the TrainerConfig (mixed precision, checkpointing, the lr schedule), `critic`: the CriticConfig,
        `offloader`: the policy's (its region holds the critic's shards and moments too). A collective."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.cfg, self.critic, self.device, self._offloader = cfg, critic, device, offloader
        model = value_model(path, attention=attention_implementation(cfg, device.type))
        if cfg.activation_checkpointing:
            checkpoint_layers(model, offload=cfg.activation_offload and device.type == "cuda")
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if cfg.mixed_precision else MixedPrecisionPolicy()
        shard_by_layer(model, mesh=mesh, device=device, offloader=offloader, mp_policy=mp_policy)
        self.model = model
        # named apart from the policy's in the NaN guards' messages
        self.params = {f"critic.{name}": p for name, p in model.named_parameters()}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=critic.lr, weight_decay=critic.weight_decay)
        self.local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())

    def values(self, batch: MicroBatch) -> torch.Tensor:
        """[rows, T-1] the value of each target position's state (fp32). A collective (FSDP2's all-gathers)."""
        logits = self.model(**batch.model_inputs()).logits  # [rows, T, 1]
        return logits[:, :-1, 0].float()

    def loss(self, batch: MicroBatch, *, scale: torch.Tensor) -> tuple[torch.Tensor, TrainStats]:
        """PPO's clipped value loss, 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2) per trained token, summed with
        `scale` (the policy's token_mean weights); a batch without returns (a rank's zero-weighted pass) gets 0."""
        self.model.train()
        values = self.values(batch)
        mask = batch.target_mask
        returns = batch.returns if batch.returns is not None else torch.zeros_like(values)
        old = batch.old_values if batch.old_values is not None else values.detach()
        unclipped = (values - returns).square()
        c = self.critic.value_clip
        if c > 0:
            clipped = (old + (values - old).clamp(-c, c) - returns).square()
            per_token, bit = 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()
        else:
            per_token, bit = 0.5 * unclipped, torch.zeros_like(unclipped)
        loss = (per_token * scale).sum()
        with torch.no_grad():
            stats = TrainStats(value_loss_sum=float((per_token * mask).sum()),
                               value_clipped_sum=float((bit * mask).sum()),
                               value_sum=float((values * mask).sum()), return_sum=float((returns * mask).sum()),
                               return_sq_sum=float((returns.square() * mask).sum()),
                               value_error_sq_sum=float(((returns - values).square() * mask).sum()))
        return loss, stats

    def train_step(self, real: list[bool], batches: list[MicroBatch], *, num_tokens: int, world_size: int,
                   **step) -> TrainStats:
        """One optimizer step of the critic on the policy's micro-batches (`real`: False for a rank's zero-weighted
        passes, run so every rank makes the same collectives), its loss summed over every rank's `num_tokens`;
        `step`: step()'s keywords. Its stats, with the grad norm, the lr and the seconds it took."""
        started = time.perf_counter()
        totals = TrainStats()
        for counted, batch in zip(real, batches):
            loss, stats = self.loss(batch, scale=batch.target_mask / max(num_tokens, 1))
            (loss * (world_size if counted else 0.0)).backward()
            if counted:
                totals += stats
        totals.critic_grad_norm, totals.critic_lr = self.step(**step)
        totals.critic_seconds = time.perf_counter() - started
        return totals

    def step(self, *, step: int, update: int, num_updates: int, num_steps: int,
             rank: int) -> tuple[float | None, float]:
        """Clip (NaN-guarded, every rank together), set the scheduled learning rate, step AdamW, check the weights;
        then drop the gradients (the policy's backward never needs them). Returns (grad norm, lr)."""
        schedule = dataclasses.replace(self.cfg, lr=self.critic.lr)  # the policy's schedule, the critic's peak
        lr = learning_rate(step * num_updates + update, schedule, num_steps=num_steps * num_updates)
        grad_norm = guarded_step(self.optimizer, self.params, max_norm=self.critic.grad_clip, lr=lr, step=step,
                                 rank=rank, create_state=lambda: create_optimizer_state(self._offloader,
                                                                                        self.optimizer))
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr
