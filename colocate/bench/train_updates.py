"""`colocate bench train --updates N`: one RL step of N optimizer steps, with and without PPO's critic, on one real
trainer rank: what the extra updates cost, and the critic's share of the step's time and memory.

    colocate bench train --updates 4                        # bench preset, 8 answers of up to 512 tokens
    colocate bench train --updates 4 model.preset=tiny

Each variant runs in a process of its own (TrainerActor, FSDP2 on gloo, world size 1), as bench train's do:

    one_update   today's step: one optimizer step, the ratio against the engine's log-probs
    n_updates    N mini-batches (algo.num_mini_batches=N), the proximal policy recomputed first (one more forward)
    ppo          the same with the critic (configs/algos/ppo.yaml's keys): its values before the first update (one
                 more forward, of the critic), GAE, and a critic update after each policy update

A first step creates AdamW's state (and the critic's); the second is timed, phase by phase: the recompute pass,
the values pass, the N policy updates and, inside them, the critic's (TrainStats.critic_seconds). Memory is the
step's peak RSS over the RSS before it, and each side's resident state (fp32 parameters and AdamW's moments).
Ratios are taken within the run, against one_update and n_updates on the same machine.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

from colocate.bench.common import machine, write_result
from colocate.bench.train import PROMPT, _sequences
from colocate.bench.train_memory import measured_readings, peak_rss_bytes, reset_peak_rss
from colocate.config import CriticConfig, JobConfig
from colocate.host.memory import process_rss_bytes, return_free_memory_to_os

LENGTH = 512
COPIES = 2  # 2 x the long-tailed group of 4 answers: 8 sequences, N mini-batches of them


def variants(num_updates: int) -> dict[str, dict]:
    n = {"num_mini_batches": num_updates, "old_logprobs": "recompute"}
    return {"one_update": {"algo": {}, "critic": {}},
            "n_updates": {"algo": n, "critic": {}},
            "ppo": {"algo": {**n, "advantage": "gae"}, "critic": {"model_path": "policy"}}}


def _state_bytes(optimizer, model) -> int:
    """The resident state as the offloader moves it (trainer/offload.py local_state), less AdamW's step scalars."""
    from colocate.trainer.offload import local_state

    return sum(t.numel() * t.element_size() for t in local_state(model, optimizer) if t.dim())


def _measure(cfg: JobConfig, keys: dict, model_path: str, port: int, queue) -> None:
    import torch

    from colocate.job.updates import mini_batches
    from colocate.rl.gae import with_gae
    from colocate.trainer.actor import TrainerActor
    from colocate.trainer.batching import trainer_micro_batches

    torch.manual_seed(0)
    algo = dataclasses.replace(cfg.algo, **keys["algo"])
    trainer_cfg = dataclasses.replace(cfg.trainer, num_threads=len(os.sched_getaffinity(0)), micro_batch_size=1)
    trainer = TrainerActor(0, 1, trainer_cfg, model_path, device="cpu", pad_id=0, algo=algo, sampling=cfg.rollout,
                           critic=CriticConfig(**keys["critic"]))
    trainer.setup("127.0.0.1", port)
    vocab = trainer.model.config.vocab_size
    seqs = [s for _ in range(COPIES) for s in _sequences(LENGTH, vocab)]

    def step(step_index: int) -> dict:
        times, sequences = {}, list(seqs)
        started = time.perf_counter()
        if algo.recomputes_proximal:
            proximal = trainer.score(sequences, num_micro_batches=len(sequences), temperature=1.0, top_p=1.0)
            sequences = [dataclasses.replace(s, old_logprobs=lp) for s, lp in zip(sequences, proximal)]
            times["recompute_s"] = time.perf_counter() - started
        if algo.advantage == "gae":
            mark = time.perf_counter()
            values = trainer.values(sequences, num_micro_batches=len(sequences))
            sequences = with_gae(sequences, values, gamma=algo.gamma, lam=algo.lam)
            times["values_s"] = time.perf_counter() - mark
        mark, critic_s = time.perf_counter(), 0.0
        batches = mini_batches(sequences, num_mini_batches=algo.num_mini_batches, num_epochs=algo.num_epochs,
                               seed=0, step=step_index)
        for k, batch in enumerate(batches):
            stats = trainer.train_step(batch, step=step_index, update=k,
                                       num_tokens_all_ranks=sum(s.num_trained_tokens for s in batch),
                                       num_micro_batches=len(trainer_micro_batches(batch, trainer.cfg)),
                                       num_seqs_all_ranks=len(batch))
            critic_s += stats.critic_seconds
        times["updates_s"] = time.perf_counter() - mark
        times["critic_update_s"] = critic_s
        times["step_s"] = time.perf_counter() - started
        return {**times, "optimizer_steps": len(batches)}

    step(0)  # AdamW's state, and the critic's
    trainer.release_grads()
    gc.collect()
    return_free_memory_to_os()
    before = process_rss_bytes()
    reset_peak_rss()
    timed = step(1)
    critic = trainer.critic
    queue.put({**timed, "rss_before_bytes": before, "peak_rss_bytes": peak_rss_bytes(),
               "policy_state_bytes": _state_bytes(trainer.optimizer, trainer.model),
               "critic_state_bytes": _state_bytes(critic.optimizer, critic.model) if critic else 0,
               "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs)})
    trainer.shutdown()
    queue.put(None)


def _run(cfg: JobConfig, keys: dict, model_path: str) -> dict:
    readings = list(measured_readings(_measure, cfg, keys, model_path))
    assert len(readings) == 1, readings
    return readings[0]


def run_updates_bench(cfg: JobConfig, *, num_updates: int, out_dir: str, name: str) -> dict:
    from colocate.models.sources import ensure_model

    model_path = ensure_model(cfg.model)
    rows = {}
    for variant, keys in variants(num_updates).items():
        row = _run(cfg, keys, model_path)
        row["step_memory_bytes"] = row["peak_rss_bytes"] - row["rss_before_bytes"]
        rows[variant] = row
        state = row["policy_state_bytes"] + row["critic_state_bytes"]
        print(f"{variant:<11} {row['optimizer_steps']} optimizer step(s)  step {row['step_s']:6.2f} s  "
              f"(recompute {row.get('recompute_s', 0):.2f}, values {row.get('values_s', 0):.2f}, updates "
              f"{row['updates_s']:.2f} of which critic {row['critic_update_s']:.2f})  step memory "
              f"{row['step_memory_bytes'] / 2**30:.2f} GiB  state {state / 2**30:.2f} GiB", flush=True)
    ppo, n, one = rows["ppo"], rows["n_updates"], rows["one_update"]
    critic_s = ppo.get("values_s", 0.0) + ppo["critic_update_s"]
    summary = {
        "n_updates_time_vs_one": n["step_s"] / one["step_s"],
        "ppo_time_vs_n_updates": ppo["step_s"] / n["step_s"],
        "critic_share_of_step_time": critic_s / ppo["step_s"],
        "critic_share_of_resident_state": ppo["critic_state_bytes"] / (ppo["critic_state_bytes"]
                                                                      + ppo["policy_state_bytes"]),
        "ppo_step_memory_vs_n_updates": ppo["step_memory_bytes"] / max(n["step_memory_bytes"], 1),
        "ppo_peak_rss_vs_n_updates": ppo["peak_rss_bytes"] / n["peak_rss_bytes"]}
    result = {"bench": "train_updates", "machine": machine(), "num_updates": num_updates,
              "answers": f"{COPIES} x (L, L/4, L/4, L/8) with L={LENGTH}, after {PROMPT}-token prompts",
              "variants": variants(num_updates), "rows": rows, **summary}
    path = write_result(result, out_dir, name)
    print(f"{num_updates} updates: {summary['n_updates_time_vs_one']:.2f}x one update's time; the critic: "
          f"{summary['critic_share_of_step_time']:.0%} of the PPO step's time, "
          f"{summary['critic_share_of_resident_state']:.0%} of the trainer's resident state, step memory "
          f"{summary['ppo_step_memory_vs_n_updates']:.2f}x without it; {path}")
    return result
