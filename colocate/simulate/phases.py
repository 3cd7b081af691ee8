"""A model of each phase of an RL step on a GPU node, from the job's config, the model's dimensions and a Hardware
(simulate/hardware.py). Times in seconds; what each term stands for and where its constant was measured is in
docs/simulate.md.

    work = Work.of(cfg, dims, prompt_tokens=512)
    engine = EngineModel(work, gpu, tp=2, memory_utilization=0.9)
    engine.step_s(running, context)            # one decode step of one engine (roofline, TP, all-reduces)
    train_s(work, gpu, ranks=8, tokens=...)    # FSDP2 over the ranks: tokens over the MFU curve, comm, AdamW
    sync_s(work, gpu, ranks=8, split=False)    # all-gather + local cast + per-bucket cost; broadcast when split
    switch_s(work, gpu, ranks=8, plan)         # sleep and wake by level, trainer offload, at the copy rates
    overlapped_s(generating, training, gain)   # the two sides at once, by how much running them together gains
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.config import JobConfig
from colocate.models.dims import ModelDims, num_adapter_params
from colocate.simulate.hardware import Hardware

BF16, FP32 = 2, 4
PER_BUCKET_S = 3.4e-3  # the ring's cost per bucket on an H200, above its bandwidth term (first GPU run)
PREFILL_EFFICIENCY = 0.5  # of peak, for a prefill's large GEMMs (the decode's compute term uses the same)
ACTIVATION_RESERVE_BYTES = 2e9  # vLLM's profiled activations and CUDA graphs beside weights and KV, per GPU
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default engine.max_num_seqs


@dataclass(frozen=True)
class Work:
    """What the model and the job ask of the hardware, independent of how it is laid out."""

    params: float  # all parameters
    active_params: float  # those one token computes through (a MoE's routed experts: the ones it picks)
    embedding_params: float  # the input embedding: looked up, not multiplied
    layers: int
    hidden: int
    attention_width: int  # query heads x head dim
    kv_bytes_per_token: float  # every layer's K and V, bf16
    prompt_tokens: int
    num_groups: int  # rollout.num_prompts
    num_samples: int
    max_num_seqs: int
    trained_params: float = 0.0  # those with gradients and AdamW state: all, or a LoRA job's adapters

    @classmethod
    def of(cls, cfg: JobConfig, dims: ModelDims, *, prompt_tokens: int) -> Work:
        embedding = dims.vocab_size * dims.hidden_size
        if dims.num_experts:  # the experts a token does not pick are weights it does not compute through
            unused = dims.num_layers * 3 * dims.hidden_size * (dims.num_experts * dims.expert_intermediate_size
                                                               - (dims.intermediate_size - dims.shared_expert_size))
            active = dims.num_params - unused
        else:
            active = dims.num_params
        return cls(params=dims.num_params, active_params=active, embedding_params=embedding,
                   layers=dims.num_layers, hidden=dims.hidden_size, attention_width=dims.num_heads * dims.head_dim,
                   kv_bytes_per_token=2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * BF16,
                   prompt_tokens=prompt_tokens, num_groups=cfg.rollout.num_prompts,
                   num_samples=cfg.rollout.num_samples,
                   max_num_seqs=cfg.engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                   trained_params=num_adapter_params(cfg, dims) if cfg.trainer.lora.rank else dims.num_params)

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16

    def flops_per_trained_token(self, sequence_tokens: float) -> float:
        """Forward and backward: 6 per parameter a token computes through (the embedding lookup aside), and causal
        attention's 6 x layers x width x position, on average half the sequence. The MFU's own count (the H200
        table's), so checkpointing's recompute is inside the MFU curve, as measured."""
        # a frozen base (LoRA) computes no weight gradients: 4 per parameter, not 6
        per_param = 6 if self.trained_params >= self.params else 4
        return per_param * (self.active_params - self.embedding_params) + 6 * self.layers * self.attention_width \
            * sequence_tokens


@dataclass(frozen=True)
class EngineModel:
    """One vLLM engine of `tp` GPUs: its decode step and its KV cache."""

    work: Work
    gpu: Hardware
    tp: int
    memory_utilization: float

    def step_s(self, running: int, context: int) -> float:
        w, g = self.work, self.gpu
        compute = 2 * w.active_params * running / (g.peak_flops * PREFILL_EFFICIENCY * self.tp)
        memory = (w.weight_bytes + w.kv_bytes_per_token * context) / (self.tp * g.hbm_bytes_per_s)
        return max(compute, memory) + g.step_overhead_s + self.all_reduce_s(running)

    def all_reduce_s(self, tokens: int) -> float:
        """TP's two all-reduces a layer (after attention and after the MLP) of the tokens' hidden states."""
        if self.tp == 1:
            return 0.0
        size = tokens * self.work.hidden * BF16 * 2 * (self.tp - 1) / self.tp  # a ring all-reduce's traffic
        return 2 * self.work.layers * (self.gpu.link_latency_s + size / self.gpu.link_bytes_per_s)

    def prefill_s(self, num_tokens: int) -> float:
        """Prompt tokens computed (with prefix caching, a group's samples share their prompt's)."""
        w = self.work
        return 2 * w.active_params * num_tokens / (self.gpu.peak_flops * PREFILL_EFFICIENCY * self.tp) \
            + self.all_reduce_s(num_tokens)

    def resume_s(self, num_tokens: int) -> float:
        """Continued answers' contexts (prompt and tokens so far) computed again: a continuation is a new request,
        and the level-2 sleep between steps has dropped the prefix cache that could have served it."""
        return self.prefill_s(num_tokens)

    @property
    def pass_s(self) -> float:
        """A pass's fixed cost beside its steps: on a GPU, within the steps' measured overhead."""
        return 0.0

    @property
    def kv_capacity_tokens(self) -> int:
        """The context tokens the KV cache holds: what engine.gpu_memory_utilization leaves of each GPU after
        the weights' share, the CUDA context and vLLM's activation reserve."""
        per_gpu = self.gpu.memory_bytes * self.memory_utilization - self.work.weight_bytes / self.tp \
            - self.gpu.context_bytes - ACTIVATION_RESERVE_BYTES
        return max(0, int(per_gpu * self.tp / self.work.kv_bytes_per_token))


def train_s(work: Work, gpu: Hardware, *, ranks: int, tokens: int, micro_batch_tokens: int,
            sequence_tokens: float, num_updates: int = 1, num_epochs: int = 1, recompute: bool = False,
            critic: bool = False) -> dict:
    """A step's training over `tokens` (prompts and answers) on `ranks` FSDP2 ranks: each micro-batch's compute
    at the MFU of its tokens, or FSDP's all-gathers (twice, with checkpointing's recompute) and reduce-scatter
    where they are longer (they overlap the compute), once an epoch (algo.num_epochs); then AdamW's pass over each
    rank's shard (memory-bound) once an optimizer step (algo.num_mini_batches x num_epochs: `num_updates`). With
    `recompute` (algo.old_logprobs), a forward pass before: a third of the compute (2 of 6 FLOPs a parameter) and
    one of FSDP's three weight passes. With `critic` (algo.advantage=gae: trainer/critic.py, the policy's backbone
    with a scalar head) the same again for the critic: its values' forward before the first update, its forward and
    backward every epoch, its AdamW every update (bench train --updates measured it at 44% of a PPO step, against
    the policy's 56% with its recompute pass)."""
    per_rank = tokens / ranks
    micro = max(1.0, min(per_rank, micro_batch_tokens))
    num_micro = max(1, round(per_rank / micro))
    compute = work.flops_per_trained_token(sequence_tokens) * micro / (gpu.peak_flops * gpu.mfu(int(micro)))
    gathered = 3 * BF16 * work.params + FP32 * work.trained_params  # all-gathers, and the trained grads' reduce
    comm = 0.0 if ranks == 1 else gathered * (ranks - 1) / ranks / gpu.link_bytes_per_s
    optimizer = 4 * 4 * 2 * work.trained_params / ranks / gpu.hbm_bytes_per_s  # params, grads, moments: r + w
    one_forward = num_micro * max(compute / 3, comm / 3)
    forward = one_forward if recompute else 0.0
    policy = num_epochs * num_micro * max(compute, comm) + num_updates * optimizer
    critic_s = policy + one_forward if critic else 0.0
    return {"seconds": policy + forward + critic_s,
            "compute_s": num_epochs * num_micro * compute, "comm_s": num_epochs * num_micro * comm,
            "optimizer_s": num_updates * optimizer, "recompute_s": forward, "critic_s": critic_s,
            "micro_batches": num_epochs * num_micro}


def sync_s(work: Work, gpu: Hardware, *, ranks: int, engine_tp: int, split: bool) -> float:
    """Co-located (the gather protocol): each layer all-gathered over the link in bf16, each rank casting its
    engine worker's slice (fp32 read, bf16 write at HBM speed), and a fixed cost per bucket (one a layer).
    Split: the trainers broadcast each TP rank's slice to the engines' GPUs over the link."""
    buckets = work.layers + 2
    if work.trained_params < work.params:  # LoRA: the adapters alone, in one bucket
        return (FP32 + BF16) * work.trained_params / gpu.hbm_bytes_per_s + PER_BUCKET_S
    if split:
        return work.weight_bytes / engine_tp / gpu.link_bytes_per_s + buckets * PER_BUCKET_S
    gather = 0.0 if ranks == 1 else work.weight_bytes * (ranks - 1) / ranks / gpu.link_bytes_per_s
    cast = (FP32 + BF16) * work.params / engine_tp / gpu.hbm_bytes_per_s
    return gather + cast + buckets * PER_BUCKET_S


def switch_s(work: Work, gpu: Hardware, *, ranks: int, engine_tp: int, sleep_level: int, offload: bool) -> dict:
    """Sleep and wake by level (1: the engine's weights to the host and back; 2: discarded, the sync rewrites
    them; the KV cache is discarded either way), and the trainer's state off the device and back (fp32 params and
    AdamW's two moments, per rank), each at the pinned host copy rate."""
    engine = 2 * work.weight_bytes / engine_tp / gpu.host_bytes_per_s if sleep_level == 1 else 0.0
    trainer = 2 * FP32 * (work.params + 2 * work.trained_params) / ranks / gpu.host_bytes_per_s if offload else 0.0
    return {"seconds": engine + trainer, "engine_s": engine, "trainer_s": trainer}


def overlapped_s(generating: float, training: float, gain: float) -> float:
    """A step whose rollout (`generating` seconds of the engines' work alone) runs beside its training (`training`,
    the trainers' work alone, the sync included). `gain`: the work done per second with both running, over one
    running alone: 2 for sides on devices of their own (a split placement's GPUs: the longer side is the step),
    about 1 for two processes time-sliced on one device (an H200 measured 0.99: the step is their sum), below 1
    where running both costs more than running each in turn (threads of both sides fighting over a CPU's cores).
    Never shorter than the longer side alone."""
    assert gain > 0
    return max(generating, training, (generating + training) / gain)
