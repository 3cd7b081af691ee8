"""colocate's train step against the preflight and against a plain PyTorch step of the same model.

A model of real width cut to a few layers (GPU: Qwen2.5-7B's shape, 4 layers, its 152k vocabulary, 2.02B
parameters; CPU: the same structure at a size CI runs) is built once and saved; then, each in a fresh process:
- colocate: `TrainerActor` at world size 1 (NCCL / gloo), bf16 mixed precision, activation checkpointing, log-probs
  in chunks of 1024 tokens, one sequence of a 64-token prompt and the rest answer, as the preflight pictures it;
- plain: the HF model in fp32 under bf16 autocast, HF's gradient checkpointing (non-reentrant), the same log-softmax
  (trainer/logprobs.py `processed_logprobs` over the full logits), gradient clipping, AdamW (foreach).
At each length a warm step runs first, then `measured` steps: tokens/s, MFU (model FLOPs: 6 x the matmul
parameters x tokens + 6 x layers x attention width x tokens^2, causal; no recompute counted) against a measured
bf16 GEMM, and the memory: resident before the step, the peak of forward+backward (up to the optimizer step) and
the optimizer step's own peak (an optimizer step pre-hook reads and resets the peak; CUDA: torch's allocated
bytes; CPU: RSS, VmHWM reset through /proc/self/clear_refs), each over the resident state, beside the preflight's
prediction (`predicted_peaks`). Then one profiled step each at the profile length: top ops by device time
(CPU time on the CPU), and every `aten::copy_` counted by where it came from (the first frame of colocate,
transformers or torch's FSDP / checkpoint / optim code in its stack): what costs colocate's step against the
plain one.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time
from collections import Counter

import torch

from colocate.bench.gpu_check.common import free_port, run_child, sync

GPU_MODEL = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                 vocab_size=152064, num_hidden_layers=4)  # Qwen2.5-7B's width, 4 of its 28 layers
CPU_MODEL = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=2,
                 vocab_size=4096, num_hidden_layers=2)
GPU_LENGTHS, CPU_LENGTHS = (4096, 8192, 16384, 32768), (192, 384)
CHUNK_TOKENS = 1024
SOURCES = ("colocate/", "transformers/", "torch/distributed/", "torch/utils/checkpoint", "torch/optim/",
           "torch/nn/functional", "torch/autograd")


def build_model(config: dict, path: str, device_type: str) -> dict:
    """A random Qwen2 of `config` saved at `path` (bf16 on disk: half the bytes; the trainers load fp32)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**config, tie_word_embeddings=False, max_position_embeddings=65536, use_cache=False)
    t0 = time.perf_counter()
    with torch.device("cuda" if device_type == "cuda" else "cpu"):  # random init is the slow part on the CPU
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return {"num_params": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - t0}


def job_config(length: int, model_path: str):
    """The job whose train phase the preflight predicts: world size 1, micro-batches of one sequence of `length`
    tokens, bf16, checkpointing, chunked log-probs."""
    from colocate.config import JobConfig
    from colocate.job.train_peaks import PROMPT_TOKENS

    cfg = JobConfig()
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=model_path),
        trainer=dataclasses.replace(cfg.trainer, micro_batch_size=1, mixed_precision=True,
                                    activation_checkpointing=True, logprob_chunk_tokens=CHUNK_TOKENS),
        rollout=dataclasses.replace(cfg.rollout, max_tokens=length - PROMPT_TOKENS, top_p=1.0, temperature=1.0),
        engine=dataclasses.replace(cfg.engine, max_model_len=max(cfg.engine.max_model_len, length), tp=1),
        placement=dataclasses.replace(cfg.placement, num_slots=1))


def predicted_peaks(cfg, dims, *, device: str) -> dict:
    """The preflight's train-step peaks for one rank (job/train_peaks.py `predict_train_peaks`): the resident
    state, and the forward+backward's and the optimizer step's peaks over it, as measured here."""
    from colocate.job.train_peaks import predict_train_peaks

    peaks = predict_train_peaks(cfg, dims, device=device)
    return {"resident_bytes": peaks.resident_bytes, "forward_backward_bytes": peaks.forward_backward_bytes,
            "optimizer_step_bytes": peaks.optimizer_step_bytes, "micro_batches": peaks.micro_batches,
            "micro_batch_shape": list(peaks.micro_batch_shape), "peak_moment": peaks.peak_moment}


def model_flops(dims, tokens: int) -> float:
    matmul_params = dims.num_params - dims.vocab_size * dims.hidden_size  # the input embedding is a lookup
    return 6.0 * matmul_params * tokens + 6.0 * dims.num_layers * dims.num_heads * dims.head_dim * tokens ** 2


def gemm_peak_flops(device: torch.device, n: int) -> float:
    """bf16 GEMM FLOP/s this device reaches on an n x n x n matmul (best of three, warmed)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    sync(device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


class PeakMeter:
    """Resident bytes before a step, the peak up to the optimizer step, the optimizer step's own peak (both over
    the resident), and the split of the step's time at the same point (optimizer hooks: torch/optim/optimizer.py
    register_step_pre_hook / register_step_post_hook)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.device = device
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)
        self.reading: dict = {}

    def _now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        from colocate.host.memory import process_rss_bytes

        return process_rss_bytes()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        from colocate.bench.train_memory import peak_rss_bytes

        return peak_rss_bytes()

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from colocate.bench.train_memory import reset_peak_rss

            reset_peak_rss()

    def start(self) -> None:
        gc.collect()
        sync(self.device)
        self.reading = {"resident": self._now()}
        self._reset()
        self.reading["started"] = time.perf_counter()

    def _pre(self, *_args) -> None:
        if "started" not in self.reading:  # a step nobody measures (the warm one)
            return
        sync(self.device)
        self.reading.update(forward_backward_peak=self._peak(), forward_backward_s=time.perf_counter()
                            - self.reading["started"], before_optimizer=self._now())
        self._reset()
        self.reading["optimizer_started"] = time.perf_counter()

    def _post(self, *_args) -> None:
        if "optimizer_started" not in self.reading:
            return
        sync(self.device)
        self.reading.update(optimizer_peak=self._peak(), optimizer_s=time.perf_counter()
                            - self.reading.pop("optimizer_started"))

    def finish(self) -> dict:
        sync(self.device)
        r = self.reading
        r["step_s"] = time.perf_counter() - r.pop("started")
        r["forward_backward_over_resident"] = r["forward_backward_peak"] - r["resident"]
        r["optimizer_over_resident"] = r["optimizer_peak"] - r["resident"]
        return r


def _sequence(length: int, vocab: int):
    from colocate.bench.train_memory import _sequences

    return _sequences(length, 1, vocab)


def _profile(step, device: torch.device, top: int = 15) -> dict:
    """One step under torch.profiler: the top ops by self device time (self CPU time on the CPU), and every
    aten::copy_ by where it came from: the nearest Python frame of colocate, transformers or torch's FSDP /
    checkpoint / optim code above it (torch 2.13's profiler records Python frames as parent events, not as an
    event's `stack`), or for a copy in the backward the autograd node that ran it; `via` is the nearest aten op
    that called it (aten::_to_copy: a cast)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        step()
        sync(device)
    timed = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = [{"name": e.key, "count": e.count, "self_us": float(getattr(e, timed, 0) or 0),
             "self_cpu_us": float(e.self_cpu_time_total)} for e in prof.key_averages()
            if ".py(" not in e.key and not e.key.startswith("<")]  # Python frames: not ops
    total = sum(r["self_us"] for r in rows) or 1.0
    rows.sort(key=lambda r: -r["self_us"])
    for r in rows:
        r["share"] = r["self_us"] / total
    copies, copy_us = Counter(), Counter()
    for event in prof.events():
        if event.name == "aten::copy_":
            where = _copy_source(event)
            copies[where] += 1
            copy_us[where] += float(getattr(event, "device_time_total" if device.type == "cuda"
                                            else "cpu_time_total", 0) or 0)
    return {"time_kind": "device" if device.type == "cuda" else "cpu", "total_self_us": total,
            "top_ops": rows[:top], "copy_calls": sum(copies.values()),
            "copy_share": sum(r["share"] for r in rows if r["name"] == "aten::copy_"),
            "copies_by_source": [{"source": k[0], "via": k[1], "calls": n, "us": copy_us[k]}
                                 for k, n in copies.most_common(15)]}


def _copy_source(event) -> tuple[str, str | None]:
    parent, via = event.cpu_parent, None
    while parent is not None:
        name = parent.name
        if via is None and name.startswith("aten::"):
            via = name
        if name.startswith("autograd::engine::evaluate_function"):
            return name.removeprefix("autograd::engine::evaluate_function: "), via
        if any(s in name for s in SOURCES):
            return name.split("site-packages/")[-1].split("/main/")[-1], via
        parent = parent.cpu_parent
    return "other", via


def _state_bytes(tensors) -> int:
    """Bytes of the parameters' and optimizer state's storages (each once): the resident state the preflight
    predicts, read from the tensors (on the CPU, RSS also holds the process's code and libraries)."""
    from colocate.host.storages import unique_storages

    return sum(s.nbytes() for s in unique_storages(tensors))


def _rates(reading: dict, length: int, dims, peak_flops: float) -> dict:
    flops = model_flops(dims, length)
    return {"tokens_per_s": length / reading["step_s"], "mfu": flops / reading["step_s"] / peak_flops}


def measure_lengths(step, lengths: list[int], *, measured: int, meter: PeakMeter, state, dims,
                    peak_flops: float) -> list[dict]:
    """At each length a warm step, then `measured` steps: the first one's memory, the fastest one's time. A length
    that runs out of device memory is recorded as such (the plain step holds the full [tokens, vocabulary]
    logits: 32k tokens x 152k in fp32 is 20 GB, with log-softmax's output as much again) and the next is tried."""
    rows = []
    for length in lengths:
        try:
            step(length)  # warm at this length: kernels and allocator blocks of its shapes
            readings = []
            for _ in range(measured):
                meter.start()
                step(length)
                readings.append(meter.finish())
        except torch.cuda.OutOfMemoryError as e:
            rows.append({"length": length, "error": f"out of memory: {str(e).splitlines()[0]}"})
            meter.reading = {}
            gc.collect()
            torch.cuda.empty_cache()
            continue
        best = min(readings, key=lambda r: r["step_s"])
        rows.append({"length": length, **readings[0], "step_s": best["step_s"], "state_bytes": _state_bytes(state()),
                     **_rates(best, length, dims, peak_flops)})
    return rows


def run_colocate(model_path: str, device_type: str, port: int, lengths: list[int], measured: int,
                 profile_length: int, dims) -> dict:
    """In a fresh process: colocate's TrainerActor at every length (warm, then measured steps), then a profile."""
    from colocate.trainer.actor import TrainerActor

    cfg = job_config(lengths[0], model_path)
    trainer = TrainerActor(0, 1, dataclasses.replace(cfg.trainer, offload="false"), model_path, device=device_type,
                           pad_id=0, algo=cfg.algo, sampling=cfg.rollout)
    trainer.setup("127.0.0.1", port)
    peak = gemm_peak_flops(trainer.device, 8192 if device_type == "cuda" else 512)
    meter, rows = PeakMeter(trainer.optimizer, trainer.device), []

    def step(length: int) -> None:
        seqs = _sequence(length, dims.vocab_size)
        n = len(seqs[0].response_ids)
        trainer.train_step(seqs, step=0, num_tokens_all_ranks=n, num_micro_batches=1, num_seqs_all_ranks=1)
        # the gradients go, not torch's cache (release_grads empties it for the engine's wake; here, as in the
        # plain step, the next step reuses the cached blocks: like with like)
        trainer.optimizer.zero_grad(set_to_none=True)

    try:
        rows = measure_lengths(step, lengths, measured=measured, meter=meter, state=trainer._state_tensors,
                               dims=dims, peak_flops=peak)
        profiled = _profile(lambda: step(profile_length), trainer.device)
    finally:
        trainer.shutdown()
    return {"rows": rows, "profile": profiled, "gemm_peak_flops": peak}


def run_plain(model_path: str, device_type: str, lengths: list[int], measured: int, profile_length: int,
              dims) -> dict:
    """In a fresh process: the same model as plain PyTorch (module docstring), the same lengths and readings."""
    from transformers import AutoModelForCausalLM

    from colocate.trainer.logprobs import processed_logprobs

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as colocate's trainer rank runs (trainer.num_threads): like with like
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    peak = gemm_peak_flops(device, 8192 if device_type == "cuda" else 512)
    meter, rows = PeakMeter(optimizer, device), []

    def step(length: int) -> None:
        seq = _sequence(length, dims.vocab_size)[0]
        ids = torch.tensor([seq.prompt_ids + seq.response_ids], device=device)
        first = len(seq.prompt_ids) - 1  # the position that predicts the first answer token
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits[:, first:-1]
        logprobs, _ = processed_logprobs(logits, ids[:, first + 1:])
        loss = -(seq.advantage * logprobs).sum() / logprobs.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def state() -> list[torch.Tensor]:
        return list(model.parameters()) + [v for group in optimizer.state.values() for v in group.values()
                                           if torch.is_tensor(v)]

    rows = measure_lengths(step, lengths, measured=measured, meter=meter, state=state, dims=dims, peak_flops=peak)
    return {"rows": rows, "profile": _profile(lambda: step(profile_length), device), "gemm_peak_flops": peak}


def train_step_section(device: torch.device, *, lengths: list[int] | None = None, measured: int = 1) -> dict:
    from colocate.models.dims import ModelDims

    cuda = device.type == "cuda"
    config = GPU_MODEL if cuda else CPU_MODEL
    lengths = list(lengths or (GPU_LENGTHS if cuda else CPU_LENGTHS))
    profile_length = lengths[len(lengths) // 2] if cuda else lengths[-1]  # 16k on the GPU
    dims = ModelDims.from_config_dict({**config, "model_type": "qwen2"})
    out = {"model": {**config, "num_params": dims.num_params}, "lengths": lengths, "measured_steps": measured,
           "profile_length": profile_length, "trainer": {"mixed_precision": True, "activation_checkpointing": True,
                                                         "logprob_chunk_tokens": CHUNK_TOKENS}}
    with tempfile.TemporaryDirectory(prefix="gpucheck-train-") as path:
        out["build"] = run_child(build_model, config, path, device.type, timeout=300)
        out["colocate"] = run_child(run_colocate, path, device.type, free_port(), lengths, measured,
                                    profile_length, dims, timeout=400)
        out["plain"] = run_child(run_plain, path, device.type, lengths, measured, profile_length, dims, timeout=400)
        predictions = {n: predicted_peaks(job_config(n, path), dims, device=device.type) for n in lengths}
    table = []
    for ours, plain in zip(out["colocate"]["rows"], out["plain"]["rows"]):
        n, predicted = ours["length"], predictions[ours["length"]]
        if "error" in ours or "error" in plain:
            table.append({"tokens": n, "predicted": predicted, "colocate_error": ours.get("error"),
                          "plain_error": plain.get("error")})
            continue
        row = {"tokens": n, "colocate_tokens_per_s": ours["tokens_per_s"], "plain_tokens_per_s": plain["tokens_per_s"],
               "ratio_colocate_over_plain": ours["tokens_per_s"] / plain["tokens_per_s"], "colocate_mfu": ours["mfu"],
               "plain_mfu": plain["mfu"], "predicted": predicted,
               "measured": {k: ours[k] for k in ("state_bytes", "resident", "forward_backward_over_resident",
                                                 "optimizer_over_resident")},
               "plain_measured": {k: plain[k] for k in ("state_bytes", "resident", "forward_backward_over_resident",
                                                        "optimizer_over_resident")}}
        for key, measured_key in (("resident_bytes", "state_bytes"),
                                  ("forward_backward_bytes", "forward_backward_over_resident"),
                                  ("optimizer_step_bytes", "optimizer_over_resident")):
            if predicted.get(key):
                row[f"{key}_measured_over_predicted"] = ours[measured_key] / predicted[key]
        table.append(row)
    out["table"] = table
    out["copies"] = {"colocate": out["colocate"]["profile"]["copy_calls"],
                     "plain": out["plain"]["profile"]["copy_calls"]}
    # colocate must train at every length (the preflight admits them); the plain step may run out of memory
    ours_ok = all("error" not in r and r["step_s"] > 0 for r in out["colocate"]["rows"])
    out["status"] = "pass" if ours_ok and len(table) == len(lengths) else "fail"
    return out
