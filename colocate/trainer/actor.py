"""TrainerActor: one FSDP2 rank (Ray actor) of a Hugging Face causal LM. Its end of the weight sync is
sync/trainer_end.py's `TrainerEnd`, which its sync methods forward to.

Every slot holds one rank; the ranks form one process group (gloo on the CPU, NCCL on GPU) and shard each
decoder layer, then the root, with `fully_shard` on dim 0. As job/runtime.py and job/groups.py drive them:

    actor = ray.remote(TrainerActor)
    trainers = [actor.options(...).remote(rank, world, cfg.trainer, model_path, device="cpu", pad_id=pad,
                                          algo=cfg.algo, sampling=cfg.rollout) for rank in range(world)]
    addr, port = ray.get(trainers[0].rendezvous.remote("127.0.0.1"))   # every rank on this node
    ray.get([t.setup.remote(addr, port) for t in trainers])
    stats = ray.get([t.train_step.remote(share, step=0, num_tokens_all_ranks=n, num_micro_batches=m,
                                         num_seqs_all_ranks=len(seqs)) for t, share in zip(trainers, shares)])
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import torch

from colocate.config import AlgoConfig, CriticConfig, RolloutConfig
from colocate.host.devices import cpu_bf16_features, device_memory, device_name, local_cuda_device
from colocate.host.memory import map_large_blocks, process_rss_bytes, return_free_memory_to_os
from colocate.sync.buckets import TensorSpec
from colocate.sync.shards import local_shards
from colocate.sync.trainer_end import Checksums, TrainerEnd
from colocate.trainer.batching import MicroBatch, attention_implementation
from colocate.trainer.finite import guarded_step
from colocate.trainer.fsdp import checkpoint_layers, shard_by_layer
from colocate.trainer.logprobs import install_chunked_head
from colocate.trainer.loss import Sequence, policy_loss, token_scale
from colocate.trainer.lr_schedule import learning_rate
from colocate.trainer.offload import create_optimizer_state, local_state, make_offloader
from colocate.trainer.scoring_passes import ScoringPasses, dummy_sequence
from colocate.trainer.stats import TrainStats
from colocate.trainer.token_returns import kl_returns, whiten_over_ranks

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TrainerActor(ScoringPasses):
    def __init__(self, rank: int, world_size: int, cfg, model_path: str, *, device: str, pad_id: int,
                 algo: AlgoConfig | None = None, sampling: RolloutConfig | None = None, engine_lora_rank: int = 0,
                 critic: CriticConfig | None = None):
        self.rank, self.world_size = rank, world_size
        self.cfg = cfg
        self.model_path = model_path
        # the loss's settings, and the sampling the engine used (its logprobs are those after temperature, top-p)
        self.algo, self.sampling = algo or AlgoConfig(), sampling or RolloutConfig()
        self.pad_id = pad_id
        self.engine_lora_rank = engine_lora_rank  # LoRA: the rank of the engine's adapter buffers (0: as resolved)
        self.device = local_cuda_device() if device == "cuda" else torch.device("cpu")
        if self.device.type == "cpu":
            map_large_blocks()  # the step's peak RSS is then its live tensors (host/memory.py)
        self.sync_end = TrainerEnd(rank=rank, world_size=world_size, device=self.device)  # every open sync
        self._offloader = None
        self.reference = None  # the frozen reference policy, built in setup when algo.kl_coef > 0
        self.replay = None  # algo.router_replay: the engine's routing replayed (trainer/router_replay.py)
        self.critic_cfg = critic or CriticConfig()
        self.critic = None  # algo.advantage=gae: the value model (trainer/critic.py), built in setup
        self._offloaded = False

    def rendezvous(self, host: str | None = None) -> tuple[str, int]:
        """Where the process group's TCPStore is, asked of rank 0 before every rank's `setup`. host=None (trainers
        on several nodes): this node's address and a free port, where rank 0's init_process_group hosts the store.
        host="127.0.0.1" (every trainer on one node): this actor hosts the store now, listening on loopback alone
        (host/rendezvous.py says why), and keeps it as long as it lives (the device mesh's groups use it too)."""
        from colocate.host.rendezvous import free_port, loopback_store

        if host is None:
            return free_port()
        self._store, port = loopback_store(host)
        return host, port

    def setup(self, master_addr: str, master_port: int) -> dict:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from transformers import AutoModelForCausalLM

        if self.device.type == "cpu":
            torch.set_num_threads(self.cfg.num_threads)
        else:
            torch.cuda.set_device(self.device)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timedelta(minutes=10))
        mesh = init_device_mesh(self.device.type, (self.world_size,))

        # loaded on the CPU, sharded onto the device a layer at a time (trainer/fsdp.py): never whole on the GPU
        self.attention = attention_implementation(self.cfg, self.device.type)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32,
                                                     attn_implementation=self.attention)
        lora = self.cfg.lora
        if lora.rank:  # before sharding: every rank builds the same adapters from its full copy
            from colocate.trainer.lora import add_lora, lora_targets

            names = sorted({n for found in lora_targets(model, lora.targets).values() for n in found})
            add_lora(model, names, rank=lora.rank, alpha=lora.alpha, seed=0)
        if self.cfg.logprob_chunk_tokens:  # before sharding: the head's weight keeps its name and its FSDP group
            install_chunked_head(model, self.cfg.logprob_chunk_tokens, fp32_logits=self.cfg.fp32_lm_head)
        if self.algo.router_replay:
            from colocate.trainer.router_replay import RouterReplay

            self.replay = RouterReplay(model)
        if self.cfg.activation_checkpointing:
            checkpoint_layers(model, offload=self.cfg.activation_offload and self.device.type == "cuda")
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.cfg.mixed_precision else MixedPrecisionPolicy()
        self._offloader = make_offloader(self.device, backend=self.cfg.offload_backend,
                                         directory=self.cfg.offload_dir or None, owner=f"trainer rank {self.rank}")
        shard_by_layer(model, mesh=mesh, device=self.device, offloader=self._offloader, mp_policy=mp_policy)
        self.model = model
        if self.algo.kl_coef > 0:
            from colocate.trainer.reference import BaseReference, ReferencePolicy

            # LoRA: the frozen base is the reference, computed by the policy with its adapters off; otherwise a
            # copy of the initial weights, built offloaded, before the engine starts and measures the free memory
            self.reference = BaseReference(model) if lora.rank else \
                ReferencePolicy(self.model_path, mesh=mesh, device=self.device, cfg=self.cfg)
        if self.critic_cfg.enabled:
            from colocate.config.critic import POLICY
            from colocate.trainer.critic import Critic

            path = self.model_path if self.critic_cfg.model_path == POLICY else self.critic_cfg.model_path
            self.critic = Critic(path, mesh=mesh, device=self.device, cfg=self.cfg, critic=self.critic_cfg,
                                 offloader=self._offloader)
        self.params = dict(model.named_parameters())
        # what the optimizer steps, the guards check and the gradients hold: with LoRA the adapters alone
        self.trained = {name: p for name, p in self.params.items() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(self.trained.values(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scaled_b = None
        self.sync_tensors = self.params  # what the engines receive, by name (sync/shards.py reads its shards)
        if lora.rank:
            from colocate.config.schema import engine_lora_rank
            from colocate.trainer.lora import ScaledB

            self.scaled_b = ScaledB(model, self.params, engine_rank=engine_lora_rank(lora.rank, self.engine_lora_rank))
            self.sync_tensors = {**self.params, **self.scaled_b.tensors}
        self.shards = local_shards(self.sync_tensors)
        return_free_memory_to_os()  # the full checkpoint every rank loaded before sharding it
        if self.device.type == "cuda":
            # the full blocks FSDP2 moved and sharded sit in torch's cache; the engine starts next and measures
            # free memory from the driver, not from torch's cache
            torch.cuda.empty_cache()
        return {"num_params": sum(p.numel() for p in model.parameters()),
                "num_trained_params": sum(p.numel() for p in self.trained.values()),
                "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
                "reference_local_bytes": self.reference.local_bytes if self.reference else 0,
                "critic_local_bytes": self.critic.local_bytes if self.critic else 0,
                "attention": self.attention,
                # which path ran: bf16 compute (FSDP2 mixed precision) or fp32, and on the CPU its native bf16
                "compute_dtype": "bfloat16" if self.cfg.mixed_precision else "float32",
                # the head's logits: fp32 unless bf16 compute rounds them, as the installed head does it
                "logits_dtype": "float32" if not self.cfg.mixed_precision or getattr(
                    model.get_output_embeddings(), "fp32_logits", False) else "bfloat16",
                **({"cpu_bf16_features": cpu_bf16_features()} if self.device.type == "cpu" else {})}

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._offloader is not None:
            self._offloader.close()
        if dist.is_initialized():
            # Hazard (teardown race): a rank that destroys its group while a peer is still in a collective or
            # still connected kills that peer's gloo I/O thread mid-flight; the peer then aborts at exit
            # ("terminate called without an active exception", seen ~1 in 20 test runs). Leave together.
            dist.barrier()
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------- training

    def train_step(self, seqs: list[Sequence], *, step: int, num_tokens_all_ranks: int, num_micro_batches: int,
                   num_seqs_all_ranks: int, update: int = 0) -> TrainStats:
        """One optimizer step over this rank's sequences, micro-batched, as update `update` (0-based) of RL step
        `step` (the learning rate counts optimizer steps: algo.num_updates a step; the NaN guard names the step);
        the loss aggregates all ranks' response tokens
        (`num_tokens_all_ranks` in `num_seqs_all_ranks` sequences) as algo.loss_aggregation says, times the world
        size (FSDP averages gradients over ranks).

        Hazard: every rank must run the same number of forward/backward passes (each is a set of FSDP
        collectives), so the caller passes the count of the rank with the most micro-batches (the same grouping,
        job/groups.py) and a rank with fewer runs zero-weighted passes instead of skipping. So does the reference
        (KL): it scores every micro-batch first, in one onload/offload, never resident beside the policy's
        activations or gradients."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = TrainStats()
        chunks = self._micro_batches(seqs, num_micro_batches)
        batches = [self._collate(chunk or list(seqs[:1]) or [dummy_sequence(self.pad_id)]) for chunk in chunks]
        ref_logprobs = self.reference.score(batches, temperature=self.sampling.temperature, top_p=self.sampling.top_p) \
            if self.reference is not None else [None] * len(batches)
        advantages = self._token_advantages(chunks, batches, ref_logprobs)
        entropy_grad = self.algo.entropy_coef > 0
        for chunk, batch, ref, adv in zip(chunks, batches, ref_logprobs, advantages):
            empty = not chunk
            logprobs, entropy = self._logprobs(batch, temperature=self.sampling.temperature,
                                               top_p=self.sampling.top_p, entropy_grad=entropy_grad)
            scale = token_scale(batch, aggregation=self.algo.loss_aggregation, num_tokens=num_tokens_all_ranks,
                                num_seqs=num_seqs_all_ranks, max_tokens=self.sampling.max_tokens)
            loss, stats = policy_loss(logprobs, batch, algo=self.algo, ref_logprobs=ref, entropy=entropy,
                                      scale=scale, advantages=adv)
            if self.replay is not None and batch.routing is not None:  # read before the backward recomputes
                flipped = self.replay.flipped(*batch.input_ids.shape)[:, :-1].to(batch.target_mask.dtype)
                stats.routing_flipped_sum = float((flipped * batch.target_mask).sum())
            (loss * (0.0 if empty else self.world_size)).backward()
            if not empty:
                totals += stats
        # NaN/Inf guards (trainer/finite.py): every rank raises together, naming the parameter, before a bad
        # gradient is stepped or a bad weight is synced; the controller then never reaches the sync.
        per_step = self.algo.num_updates
        totals.lr = learning_rate(step * per_step + update, self.cfg, num_steps=self.algo.num_steps * per_step)
        totals.grad_norm = guarded_step(self.optimizer, self.trained, max_norm=self.cfg.grad_clip, lr=totals.lr,
                                        step=step, rank=self.rank, create_state=self._create_optimizer_state)
        if self.scaled_b is not None:
            self.scaled_b.refresh()
        if self.critic is not None:
            # after the policy's step, its gradients dropped: the two never hold gradients at once
            for p in self.trained.values():
                p.grad = None
            totals += self.critic.train_step([bool(c) for c in chunks], batches, num_tokens=num_tokens_all_ranks,
                                             world_size=self.world_size, step=step, update=update,
                                             num_updates=self.algo.num_updates, num_steps=self.algo.num_steps,
                                             rank=self.rank)
        return totals

    def _token_advantages(self, chunks: list[list[Sequence]], batches: list[MicroBatch],
                          ref_logprobs: list) -> list[torch.Tensor | None]:
        """Per-token advantages where they are not the sequence's: REINFORCE++ with the KL in its returns
        (trainer/token_returns.py; a collective over the ranks). None: each micro-batch's own."""
        if not self.algo.kl_in_reward:
            return [None] * len(batches)
        returns = [kl_returns(b, ref, kl_coef=self.algo.kl_coef, estimator=self.algo.kl_estimator)
                   for b, ref in zip(batches, ref_logprobs)]
        # the zero-weighted passes of a rank with fewer micro-batches count no token
        masks = [b.target_mask if chunk else torch.zeros_like(b.target_mask) for chunk, b in zip(chunks, batches)]
        return whiten_over_ranks(returns, masks)

    def _create_optimizer_state(self) -> None:
        """The policy's AdamW state, and the critic's, in the offloader's region (trainer/offload.py
        create_optimizer_state)."""
        create_optimizer_state(self._offloader, self.optimizer)
        if self.critic is not None and not self.critic.optimizer.state:
            create_optimizer_state(self._offloader, self.critic.optimizer)

    # ---------------------------------------------------------------------------------------- weight sync

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """A LoRA job's adapter parameters (PEFT names, full shapes): what the engine installs (engine/lora.py)."""
        return {name: tuple(p.shape) for name, p in self.trained.items()} if self.scaled_b is not None else {}

    def param_specs(self, engine_dtype: str) -> list[TensorSpec]:
        dtype = DTYPES[engine_dtype]
        return [TensorSpec(name, tuple(p.shape), dtype) for name, p in self.sync_tensors.items()]

    # The trainer end of every protocol is sync/trainer_end.py's `TrainerEnd`; these are the Ray methods
    # WeightSync calls it by. Hazard: offloaded storages have size 0, and reading them through the shard views
    # would crash the process. The controller syncs before it offloads; a caller that syncs an offloaded trainer
    # gets it back in each write (_resident_shards).

    def attach_ring(self, *args, **kwargs) -> None:
        self.sync_end.attach_ring(*args, **kwargs)

    def write_bucket(self, key: str, engine_index: int, index: int, *after) -> Checksums:
        """`after`: the engine's load of the bucket that last used this ring slot; Ray runs this call only once
        it finished, so a slot is never overwritten mid-load."""
        return self.sync_end.write_bucket(key, engine_index, index, self._resident_shards())

    def write_in_place(self, key: str, engine_index: int) -> Checksums:
        return self.sync_end.write_in_place(key, engine_index, self._resident_shards())

    def attach_gather(self, *args, **kwargs) -> None:
        self.sync_end.attach_gather(*args, **kwargs)

    def gather_write(self, key: str, index: int, after: list) -> Checksums:
        return self.sync_end.gather_write(key, index, after, self._resident_shards())

    def open_broadcast_stores(self, *args, **kwargs) -> dict:
        return self.sync_end.open_broadcast_stores(*args, **kwargs)

    def attach_broadcast(self, *args, **kwargs) -> None:
        self.sync_end.attach_broadcast(*args, **kwargs)

    def take_delta_stats(self, key: str) -> dict | None:
        return self.sync_end.take_delta_stats(key)

    def replay_bucket(self, key: str, index: int) -> Checksums:
        return self.sync_end.replay_bucket(key, index)

    def store_version(self, key: str) -> int:
        return self.sync_end.store_version(key)

    def broadcast_write(self, key: str, index: int) -> Checksums:
        return self.sync_end.broadcast_write(key, index, self._resident_shards())

    def _resident_shards(self) -> dict:
        self.onload()
        return self.shards

    def cast_floor_s(self, num_bytes: int, dtype: str, *, repeats: int = 5) -> float:
        return self.sync_end.cast_floor_s(num_bytes, DTYPES[dtype], repeats=repeats)

    def profile_sync_write(self, key: str, *, repeats: int = 5) -> dict:
        return self.sync_end.profile(key, self.shards, repeats=repeats)

    def take_write_times(self) -> list[tuple[int, float]]:
        return self.sync_end.take_write_times()

    def full_state_dict(self, dtype: str, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """All-gathered full parameters cast to `dtype` (a collective: call it on every rank). For verification,
        and for the benchmark's naive baseline (rank 0 ships the whole model through Ray's object store)."""
        target = DTYPES[dtype]
        with self._resident():  # a verification may come while the engine runs: the state back for the gather
            # copy=True: with one rank, full_tensor() is a view of the live shard, which offload() releases
            state = {name: p.full_tensor().detach().to("cpu", dtype=target, copy=True)
                     for name, p in self.sync_tensors.items()}
        return None if rank0_only and self.rank else state

    # --------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """This rank's shards of the model and optimizer (a collective: every rank calls it), wherever the
        state is now; an offloaded state comes back for the write and goes out again."""
        from colocate.checkpoint.rank_state import save_rank_state

        with self._resident():
            if not self.optimizer.state:  # no step trained yet (dynamic sampling kept no group): AdamW's zero state
                self._create_optimizer_state()
            save_rank_state(directory, self.model, self.optimizer, rank=self.rank)
            if self.critic is not None:
                save_rank_state(directory, self.critic.model, self.critic.optimizer, rank=self.rank, name="critic")

    def load_checkpoint(self, directory: str) -> None:
        """Read a checkpoint into the live shards (a collective). The optimizer's state is created first, in the
        offloader's region as a step would create it, then overwritten in place."""
        from colocate.checkpoint.rank_state import load_rank_state

        with self._resident():
            if not self.optimizer.state:
                self._create_optimizer_state()
            load_rank_state(directory, self.model, self.optimizer, rank=self.rank)
            if self.critic is not None:
                load_rank_state(directory, self.critic.model, self.critic.optimizer, rank=self.rank, name="critic")
            if self.scaled_b is not None:
                self.scaled_b.refresh()

    # ------------------------------------------------------------------------------------- memory switch

    def release_grads(self) -> int:
        """Drop the gradients right after the optimizer step (the next step recomputes them)."""
        released = 0
        for p in self.model.parameters():
            if p.grad is not None:
                released += p.grad.to_local().numel() * p.grad.element_size()
                p.grad = None
        # and the step's activations, freed when it returned: without a trim glibc keeps all of it, and the
        # engine wakes next to memory the trainer no longer uses (measured: +4 GB during the bench preset's sync)
        return_free_memory_to_os()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # vLLM's wake allocates from the driver: torch's cache would starve it
        return released

    def offload(self) -> int:
        """Parameters and optimizer state out of the device's memory while the engine runs (to pinned host
        buffers on CUDA, to a file-backed tier on the CPU). Returns the bytes moved."""
        if self._offloaded:
            return 0
        self._offloaded = True
        return self._offloader.offload(self._state_tensors())

    def onload(self) -> int:
        if not self._offloaded:
            return 0
        self._offloaded = False
        return self._offloader.onload()

    @contextmanager
    def _resident(self):
        """The state on the device for the block, and back where it was after it (offloaded or not)."""
        offloaded = self._offloaded
        self.onload()
        yield
        if offloaded:
            self.offload()

    def _state_tensors(self) -> list[torch.Tensor]:
        """The policy's state and the critic's: one offloader moves both (trainer/critic.py)."""
        tensors = local_state(self.model, self.optimizer)
        return tensors + (local_state(self.critic.model, self.critic.optimizer) if self.critic is not None else [])

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def device_name(self) -> str:
        """This rank's device, named alike in every process (trainer rank s lives in slot s)."""
        return device_name(self.device, slot=self.rank)

    def rss_bytes(self) -> int:
        return process_rss_bytes(shared_memory=False)

    def memory(self) -> dict[str, int]:
        return {"rss_bytes": self.rss_bytes(), **device_memory(self.device)}
