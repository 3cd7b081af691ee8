"""TrainerActor: one FSDP2 rank (Ray actor) of a Hugging Face causal LM, with its side of the weight sync.

Every slot holds one rank; the ranks form one process group (gloo on the CPU, NCCL on GPU) and shard each
decoder layer, then the root, with `fully_shard` on dim 0.

    trainers = [TrainerActor.options(...).remote(rank, world, cfg, path, device="cpu", ...) for rank ...]
    addr, port = ray.get(trainers[0].rendezvous.remote())
    ray.get([t.setup.remote(addr, port) for t in trainers])
    ray.get([t.train_step.remote(seqs[rank::world], num_tokens) for rank, t in enumerate(trainers)])
"""

from __future__ import annotations

import os
import time
from collections import deque
from datetime import timedelta

import torch

from colocate.config import AlgoConfig, RolloutConfig
from colocate.host.devices import copy_seconds, cpu_bf16_features, device_memory, device_name, local_cuda_device
from colocate.host.memory import map_large_blocks, process_rss_bytes, return_free_memory_to_os
from colocate.sync.buckets import TensorSpec
from colocate.sync.reshard import SyncPlan
from colocate.sync.shards import bucket_copies, local_shards, profile_copies, run_copies
from colocate.trainer.batching import MicroBatch, attention_implementation, collate, trainer_micro_batches
from colocate.trainer.finite import check_weights, clip_checked
from colocate.trainer.fsdp import checkpoint_layers, shard_by_layer
from colocate.trainer.logprobs import install_chunked_head, sequence_logprobs
from colocate.trainer.loss import Sequence, policy_loss, token_scale
from colocate.trainer.lr_schedule import learning_rate
from colocate.trainer.offload import make_offloader
from colocate.trainer.stats import TrainStats
from colocate.trainer.token_returns import kl_returns, whiten_over_ranks

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class TrainerActor:
    def __init__(self, rank: int, world_size: int, cfg, model_path: str, *, device: str, pad_id: int,
                 algo: AlgoConfig | None = None, sampling: RolloutConfig | None = None, engine_lora_rank: int = 0):
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
        self._rings = {}
        self._gather_writers: dict = {}  # sync key -> GatherWriter (the gather protocol)
        self._broadcast_stores: dict = {}  # sync key -> {TP rank: (TCPStore, StoreAddress)}, until attached
        self._feeders: dict = {}  # sync key -> BroadcastFeeder (split placement)
        self._copies: dict = {}
        self._offloader = None
        self.reference = None  # the frozen reference policy, built in setup when algo.kl_coef > 0
        # bounded: a long run never asks for them (only the sync benchmark does)
        self.write_times: deque[tuple[int, float]] = deque(maxlen=4096)
        self._offloaded = False

    def rendezvous(self, host: str | None = None) -> tuple[str, int]:
        """Where the process group's TCPStore is, asked of rank 0 before every rank's `setup`.

        host=None (trainers on several nodes): (this node's address, a free port), and rank 0's
        init_process_group hosts the store there. host="127.0.0.1" (every trainer on one node): this actor hosts
        the store now, on a socket bound to loopback only, and returns its port.

        Why: torch's TCPStore server listens on every interface whatever MASTER_ADDR says (torch 2.13: '::' for
        a store meant for 127.0.0.1), so anyone who reaches the node could write keys into the rendezvous.
        Handed a listening socket (master_listen_fd, as vLLM does in distributed/utils.py create_tcp_store) it
        listens on that one only. Hazard: the ranks must then run with TORCHELASTIC_USE_AGENT_STORE=True (the
        runtime sets it), which makes every rank's init_process_group a client of this store; without it rank 0
        would try to host a second store on the same port."""
        import socket

        import ray

        if host is None:
            with socket.socket() as sock:
                sock.bind(("", 0))
                port = sock.getsockname()[1]
            return ray.util.get_node_ip_address(), port
        import torch.distributed as dist

        sock = socket.socket()
        sock.bind((host, 0))
        sock.listen()
        port = sock.getsockname()[1]
        fd = sock.detach()
        try:  # kept as long as the actor lives: the groups created after setup (device mesh) use it too
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                                        timeout=timedelta(minutes=10))
        except BaseException:
            os.close(fd)
            raise
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
            install_chunked_head(model, self.cfg.logprob_chunk_tokens)
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
                "attention": self.attention,
                # which path ran: bf16 compute (FSDP2 mixed precision) or fp32, and on the CPU its native bf16
                "compute_dtype": "bfloat16" if self.cfg.mixed_precision else "float32",
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
                   num_seqs_all_ranks: int) -> TrainStats:
        """One optimizer step over this rank's sequences, micro-batched, as RL step `step` (0-based: its learning
        rate, and the step a NaN guard names); the loss aggregates all ranks' response tokens
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
        batches = [self._collate(chunk or list(seqs[:1]) or [_dummy_sequence(self.pad_id)]) for chunk in chunks]
        ref_logprobs = self.reference.score(batches, temperature=self.sampling.temperature, top_p=self.sampling.top_p) \
            if self.reference is not None else [None] * len(batches)
        advantages = self._token_advantages(chunks, batches, ref_logprobs)
        entropy_grad = self.algo.entropy_coef > 0
        for chunk, batch, ref, adv in zip(chunks, batches, ref_logprobs, advantages):
            empty = not chunk
            logprobs, entropy = sequence_logprobs(self.model, batch, temperature=self.sampling.temperature,
                                                  top_p=self.sampling.top_p, entropy_grad=entropy_grad)
            scale = token_scale(batch, aggregation=self.algo.loss_aggregation, num_tokens=num_tokens_all_ranks,
                                num_seqs=num_seqs_all_ranks, max_tokens=self.sampling.max_tokens)
            loss, stats = policy_loss(logprobs, batch, algo=self.algo, ref_logprobs=ref, entropy=entropy,
                                      scale=scale, advantages=adv)
            (loss * (0.0 if empty else self.world_size)).backward()
            if not empty:
                totals += stats
        # NaN/Inf guards (trainer/finite.py): every rank raises together, naming the parameter, before a bad
        # gradient is stepped or a bad weight is synced; the controller then never reaches the sync.
        totals.grad_norm = clip_checked(self.trained, self.cfg.grad_clip, step=step, rank=self.rank)
        if not self.optimizer.state:
            self._create_optimizer_state()
        totals.lr = learning_rate(step, self.cfg, num_steps=self.algo.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = totals.lr
        self.optimizer.step()
        check_weights(self.trained, step=step, rank=self.rank)
        if self.scaled_b is not None:
            self.scaled_b.refresh()
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
        """AdamW's lazy state, created by hand inside the offloader's region (torch_memory_saver pauses it with
        the parameters), exactly as `Adam._init_group` creates it (torch/optim/adam.py: step a CPU scalar, the
        moments zeros like the parameter), so the step itself and its temporaries run outside the region."""
        with self._offloader.allocation_region():
            for group in self.optimizer.param_groups:
                assert not (group["fused"] or group["capturable"] or group["amsgrad"]), "mirror Adam._init_group"
                for p in group["params"]:
                    self.optimizer.state[p].update(
                        step=torch.tensor(0.0, dtype=torch.float32),
                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))

    @torch.no_grad()
    def score(self, seqs: list[Sequence], *, num_micro_batches: int, temperature: float,
              top_p: float) -> list[list[float]]:
        """The trainer's logprob of every response token of `seqs` under the sampling they came from (as the
        loss sees them), without training. A collective, like train_step: every rank runs `num_micro_batches`."""
        out: dict[int, list[float]] = {}
        index = {id(s): i for i, s in enumerate(seqs)}
        for chunk in self._micro_batches(seqs, num_micro_batches):
            batch = self._collate(chunk or [_dummy_sequence(self.pad_id)])
            logprobs = sequence_logprobs(self.model, batch, temperature=temperature, top_p=top_p)[0].cpu()
            for s, (row, first, num) in zip(chunk, batch.spans):
                out[index[id(s)]] = logprobs[row, first:first + num].tolist()
        return [out[i] for i in range(len(seqs))]

    def _micro_batches(self, seqs: list[Sequence], num_micro_batches: int) -> list[list[Sequence]]:
        """This rank's micro-batches (trainer/batching.py), then empty ones up to the count every rank runs."""
        groups = trainer_micro_batches(seqs, self.cfg)
        assert len(groups) <= num_micro_batches, (len(groups), num_micro_batches)
        return groups + [[] for _ in range(num_micro_batches - len(groups))]

    def _collate(self, seqs: list[Sequence]) -> MicroBatch:
        return collate(seqs, pad_id=self.pad_id, device=self.device, packed=self.cfg.pack_sequences)

    # ---------------------------------------------------------------------------------------- weight sync

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """A LoRA job's adapter parameters (PEFT names, full shapes): what the engine installs (engine/lora.py)."""
        return {name: tuple(p.shape) for name, p in self.trained.items()} if self.scaled_b is not None else {}

    def param_specs(self, engine_dtype: str) -> list[TensorSpec]:
        dtype = DTYPES[engine_dtype]
        return [TensorSpec(name, tuple(p.shape), dtype) for name, p in self.sync_tensors.items()]

    def attach_ring(self, key: str, engine_index: int, handles: list, plan: SyncPlan, *, checksum: bool) -> None:
        """Map the rings of one engine's workers for sync `key` (`handles` by TP rank; a shared ring is mapped
        once)."""
        from colocate.sync.buffers import attach

        mapped: dict = {}
        rings = []
        for handle in handles:
            key_of = getattr(handle, "name", None) or id(handle)  # a shared segment arrives once per worker
            if key_of not in mapped:
                mapped[key_of] = attach(handle)
            rings.append(mapped[key_of])
        self._rings[key, engine_index] = (rings, plan, checksum)
        self._copies[key, engine_index] = {}  # bucket index -> its copies, built on first use

    def write_bucket(self, key: str, engine_index: int, index: int, *after) -> list[tuple[int, int, int, int]]:
        """Write this rank's part of bucket `index`. `after`: the engine's load of the bucket that last used this
        ring slot; Ray runs this call only once it finished, so a slot is never overwritten mid-load."""
        # Hazard: offloaded storages have size 0; reading them through the shard views would crash the process.
        # The controller syncs before it offloads; a caller that syncs an offloaded trainer brings it back here.
        self.onload()
        rings, plan, checksum = self._rings[key, engine_index]
        started = time.perf_counter()
        copies = self._copies[key, engine_index]
        if index not in copies:
            copies[index] = bucket_copies(plan, index, self.shards, rings)
        written = run_copies(copies[index], checksum=checksum)
        self.write_times.append((index, time.perf_counter() - started))
        return written

    def write_in_place(self, key: str, engine_index: int) -> list[tuple[int, int, int, int]]:
        """Write this rank's part of every bucket, in order, straight into the engine's parameters (no slot to
        wait for). Returns the checksums of all of them."""
        rings, plan, _ = self._rings[key, engine_index]
        assert plan.in_place
        return [c for index in range(len(plan.buckets)) for c in self.write_bucket(key, engine_index, index)]

    def attach_gather(self, key: str, plan: SyncPlan, groups: dict, pair: tuple[int, int] | None, handle, *,
                      checksum: bool) -> None:
        """The gather protocol for sync `key`: this rank all-gathers every layer group with the other ranks and
        feeds only `pair` (engine, tp rank), the worker on its own device, through that worker's ring
        (`handle`); a rank with no worker beside it (pair None) takes part in the gather only."""
        from colocate.sync.gather import GatherWriter
        from colocate.sync.buffers import attach

        self._gather_writers[key] = GatherWriter(
            plan, groups, rank=self.rank, world_size=self.world_size, device=self.device,
            targets=[(pair[1], attach(handle))] if pair is not None else [], checksum=checksum)

    def gather_write(self, key: str, index: int, after: list) -> list[tuple[int, int, int, int]]:
        """Bucket `index` of a gather sync (see attach_gather). `after`: [the paired engine's load of the bucket
        that last used this ring slot], waited for here: the slot is free once it returned. If that load failed,
        this rank still takes part in the all-gather (every rank must, or the group falls out of step), writes
        nothing, and raises the load's error."""
        import ray

        self.onload()  # as in write_bucket: a caller may sync an offloaded trainer
        failed = None
        try:
            ray.get(after)
        except Exception as e:  # the engine's error, raised again once the collective is done
            failed = e
        started = time.perf_counter()
        written = self._gather_writers[key].write(index, self.shards, copy=failed is None)
        self.write_times.append((index, time.perf_counter() - started))
        if failed is not None:
            raise failed
        return written

    def open_broadcast_stores(self, key: str, *, tp: int, num_members: int, loopback: bool,
                              timeout_s: float) -> dict:
        """Split placement, first half of opening sync `key`: a store for the group of every TP rank this rank
        feeds (sync/broadcast.py), on a free port. Returns {TP rank: StoreAddress} for the engine workers."""
        from colocate.sync.broadcast import fed_by, node_address, open_store

        host = node_address(loopback)
        stores = {t: open_store(host, f"{key}-tp{t}", size=num_members, timeout_s=timeout_s)
                  for t in fed_by(self.rank, tp=tp, num_trainer_ranks=self.world_size)}
        self._broadcast_stores[key] = stores
        return {t: address for t, (_, address) in stores.items()}

    def attach_broadcast(self, key: str, plan: SyncPlan, groups: dict, *, num_members: int, timeout_s: float,
                         checksum: bool) -> None:
        """Second half: join the groups (this blocks until their engine workers join too: call it beside the
        engines' open_ring) and stage the fed TP ranks' slices. A rank that feeds none gathers only."""
        from colocate.sync.broadcast import BroadcastChannel, BroadcastFeeder

        channels = {t: BroadcastChannel.join(address, rank=0, size=num_members, device=self.device,
                                             timeout_s=timeout_s, store=store)
                    for t, (store, address) in self._broadcast_stores.pop(key).items()}
        self._feeders[key] = BroadcastFeeder.create(plan, groups, rank=self.rank, world_size=self.world_size,
                                                    device=self.device, channels=channels, checksum=checksum)

    def broadcast_write(self, key: str, index: int) -> list[tuple[int, int, int, int]]:
        """Bucket `index` of a broadcast sync: gather (every rank), then send each fed TP rank its slice; returns
        once the engines' workers received it (their receive runs beside this call, never after it)."""
        self.onload()  # as in write_bucket: a caller may sync an offloaded trainer
        started = time.perf_counter()
        written = self._feeders[key].write(index, self.shards)
        self.write_times.append((index, time.perf_counter() - started))
        return written

    def cast_floor_s(self, num_bytes: int, dtype: str, *, repeats: int = 5) -> float:
        """Benchmark floor: median seconds for this process to cast fp32 values into `num_bytes` of `dtype` on its
        device, the least any sync from fp32 shards to a bf16 engine costs it (it reads 2 bytes per byte)."""
        target = DTYPES[dtype]
        source = torch.ones(num_bytes // target.itemsize, dtype=torch.float32, device=self.device)
        return copy_seconds(torch.empty(source.shape, dtype=target, device=self.device), source, repeats=repeats)

    def profile_sync_write(self, key: str, *, repeats: int = 5) -> dict:
        """Benchmark breakdown: this rank's copies of every bucket of ring or in-place sync `key`, into every
        engine, replayed and timed by source layout, and their checksum (sync/shards.py `profile_copies`).
        Hazard: the replay writes into the engine what the last sync wrote; call it right after a sync, before the
        parameters change, or the engine holds weights no sync verified."""
        copies = [c for (k, _), (rings, plan, _) in self._rings.items() if k == key
                  for index in range(len(plan.buckets)) for c in bucket_copies(plan, index, self.shards, rings)]
        return profile_copies(copies, repeats=repeats)

    def take_write_times(self) -> list[tuple[int, float]]:
        """(bucket index, seconds) of every write since the last call (benchmark breakdown)."""
        times = list(self.write_times)
        self.write_times.clear()
        return times

    def full_state_dict(self, dtype: str, *, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """All-gathered full parameters cast to `dtype` (a collective: call it on every rank). For verification,
        and for the benchmark's naive baseline (rank 0 ships the whole model through Ray's object store)."""
        target = DTYPES[dtype]
        offloaded = self._offloaded
        self.onload()  # a verification may come while the engine runs: bring the state back for the gather
        # copy=True: with one rank, full_tensor() is a view of the live shard, which offload() releases
        state = {name: p.full_tensor().detach().to("cpu", dtype=target, copy=True)
                 for name, p in self.sync_tensors.items()}
        if offloaded:
            self.offload()
        return None if rank0_only and self.rank else state

    # --------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """This rank's shards of the model and optimizer (a collective: every rank calls it), wherever the
        state is now; an offloaded state comes back for the write and goes out again."""
        from colocate.checkpoint.rank_state import save_rank_state

        offloaded = self._offloaded
        self.onload()
        if not self.optimizer.state:  # no step trained yet (dynamic sampling kept no group): AdamW's zero state
            self._create_optimizer_state()
        save_rank_state(directory, self.model, self.optimizer, rank=self.rank)
        if offloaded:
            self.offload()

    def load_checkpoint(self, directory: str) -> None:
        """Read a checkpoint into the live shards (a collective). The optimizer's state is created first, in the
        offloader's region as a step would create it, then overwritten in place."""
        from colocate.checkpoint.rank_state import load_rank_state

        offloaded = self._offloaded
        self.onload()
        if not self.optimizer.state:
            self._create_optimizer_state()
        load_rank_state(directory, self.model, self.optimizer, rank=self.rank)
        if self.scaled_b is not None:
            self.scaled_b.refresh()
        if offloaded:
            self.offload()

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

    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = [p.to_local() for p in self.model.parameters()]
        for state in self.optimizer.state.values():
            tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values() if torch.is_tensor(v)]
        return tensors

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


def _dummy_sequence(pad_id: int) -> Sequence:
    return Sequence(prompt_ids=[pad_id], response_ids=[pad_id], logprobs=[0.0], advantage=0.0)
