"""The controller: one RL step is rollout -> score -> train -> sync, with memory switched between phases.

    prompts ──> rollout (engines, awake) ──> score (reward fn) ──> advantages (algo.advantage)
                      └── dynamic sampling: drop uniform groups, roll out more ──┘
                                                  │
                 engine.sleep(level) ; trainer.onload
                                                  │
                                              train (FSDP2 ranks, GRPO)
                                                  │
                 trainer.release_grads ; engine.wake(weights)
                                                  │
                                              sync (trainer shards -> ring -> engine workers)
                                                  │
                 trainer.offload ; engine.wake(kv_cache)  ──> next step

algo.mode=one_step_off (docs/async.md) starts step k+1's rollout in a thread (job.overlap) once step k's
groups are scored, trains meanwhile, and waits for it before the sync; nothing sleeps or moves in that mode.
algo.mode=async runs rollout passes without pause in a thread (job.overlap.ContinuousRollout): a step takes
complete groups from it, and its sync waits only for the pass in flight to end (pause, sync, resume).

After the sync, when due: evaluation on the validation prompts (rl.evaluation, the same engines, awake) and a
checkpoint (colocate.checkpoint.layout: trainer shards, data place, unfinished answers). A resumed run loads the
checkpoint, syncs the loaded weights into the engines, and goes on with the next step.

The switching order is written down here and only here. It keeps each side's large state off the device while
the other side runs: the engine's KV cache is never resident with the trainer's gradients and optimizer state,
and the engine's weights come back (empty at level 2) only to receive the sync, never beside a second copy.
What moves at all is the runtime's switch plan (`rt.switch`, from the memory preflight): a side whose state
fits beside the other's phase stays where it is (engine sleep level 0, trainer state kept), and its steps of
the order above are skipped.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections import deque
from pathlib import Path

import torch

from colocate.checkpoint.checkpointer import Checkpointer
from colocate.config import JobConfig
from colocate.job.faults import Watchdog
from colocate.job.overlap import Background, ContinuousRollout
from colocate.job.runtime import Runtime
from colocate.rl.corrections import mismatch_stats
from colocate.rl.data import PromptSource, make_prompt_source
from colocate.rl.evaluation import make_evaluator, should_evaluate
from colocate.rl.rewards import make_reward
from colocate.rl.rollout import Rollouts, staleness
from colocate.rl.scoring import Rollout, Scored, ScoredGroup, keep_informative, reward_groups
from colocate.rl.tasks import make_task
from colocate.telemetry.metrics import MetricsWriter

HISTORY_KEPT = 1000


class Controller:
    def __init__(self, cfg: JobConfig, runtime: Runtime, metrics: MetricsWriter | None = None,
                 rollouts: Rollouts | None = None, prompts: PromptSource | None = None,
                 resume_from: Path | None = None):
        """`prompts`: a source built (and its files checked) before the runtime started; by default it is built
        here, from data.train_files or the toy task. `resume_from`: a checkpoint checked against the job
        (checkpoint.resume_point) to continue from."""
        self.cfg = cfg
        self.rt = runtime
        self.metrics = metrics
        self.task = make_task(cfg.rollout.task, length=cfg.rollout.task_length)
        self.reward_fn = make_reward(cfg, self.task, runtime.reward_model)
        # the prompt source is built only when no Rollouts (which holds its own) is given
        self.rollouts = rollouts or Rollouts(cfg, runtime.engines, runtime.tokenizer,
                                             prompts or make_prompt_source(cfg, runtime.tokenizer, self.task),
                                             env_workers=runtime.env_workers)
        self.evaluator = make_evaluator(cfg, runtime.engines, runtime.tokenizer, self.reward_fn, self.task)
        self.checkpointer = Checkpointer(cfg, runtime.model_path)
        self.resume_from = resume_from
        self.watchdog: Watchdog | None = None  # run() watches the actors; a test's step() alone does not
        # Bounded: a run of days must not grow with its steps (the soak bench measured ~9 KiB per step when
        # every record stayed); metrics.jsonl keeps them all.
        self.events: deque[str] = deque(maxlen=10_000)  # the switching order, as it happened (tests assert it)
        self.history: deque[dict] = deque(maxlen=HISTORY_KEPT)  # the newest step records
        # (phase, step, start, end) in perf_counter seconds, the newest phases: `bench async`'s timeline
        self.spans: deque[tuple[str, int | None, float, float]] = deque(maxlen=HISTORY_KEPT * 10)
        self.first_record: dict | None = None
        self.num_done = 0  # steps finished by this controller
        self._generated_ahead = False  # one_step_off: the pool holds the next step's groups, generated ahead
        self._continuous: ContinuousRollout | None = None  # async: the passes' thread, started by the first rollout

    def run(self) -> list[dict]:
        with Watchdog(self.cfg.fault, self.rt) as self.watchdog:
            try:
                first = 0
                if self.resume_from:
                    with self._phase({}, "restore"):
                        first = self.restore(self.resume_from)
                return self.run_steps(self.cfg.algo.num_steps, first=first)
            except KeyboardInterrupt:
                # the watchdog's interrupt can land just after its phase ended (it is delivered at the main
                # thread's next bytecode): it is still the fault, not a Ctrl-C
                if self.watchdog.fault is not None:
                    raise self.watchdog.fault from None
                raise
            finally:
                self.close()

    def run_steps(self, num_steps: int, *, first: int = 0) -> list[dict]:
        """Steps first .. num_steps - 1 (a resumed run starts after its checkpoint's step)."""
        if first == 0 and self.evaluator and should_evaluate(self.cfg.eval, 0, num_steps):
            with self._phase({}, "eval"):
                result = self.evaluate(0)
            if self.metrics:
                self.metrics.evaluation(result, num_done=0)
        if self.rt.switch.trainer_offload:
            with self._phase({}, "switch"):
                self.rt.trainers.offload()  # the engine runs first
            self.events.append("trainer.offload")
        for step in range(first, num_steps):
            self.step(step, num_steps=num_steps)
        return list(self.history)

    def step(self, step: int, *, num_steps: int | None = None) -> dict:
        num_steps = num_steps or self.cfg.algo.num_steps
        times: dict[str, float] = {}
        with self._phase(times, "rollout", step):
            groups, rollout_stats = self.rollout(step)
        with self._phase(times, "score", step):
            scored_groups = self.score(groups)
        if self.cfg.algo.dynamic_sampling:
            scored_groups = self.refill(step, scored_groups, rollout_stats, times)
        scored = self.advantages(scored_groups)
        ahead = self.start_next_rollout(step, num_steps)  # one_step_off: the engines generate step + 1's answers
        with self._phase(times, "switch", step):
            self.switch_to_train()
        with self._phase(times, "train", step):
            train_stats = self.train(scored, step)
        with self._phase(times, "switch", step):
            self.switch_to_sync()
        if ahead is not None or self._continuous is not None:
            with self._phase(times, "rollout_wait", step):  # the trainer idles until the engines are done
                self.wait_for_engines(ahead, step)
        with self._phase(times, "sync", step):
            sync_stats = self.sync()
        if self.checkpointer.due(step + 1, num_steps):
            with self._phase(times, "checkpoint", step):
                self.save_checkpoint(step)
        with self._phase(times, "switch", step):
            self.switch_to_rollout()
        evaluation = None
        if self.evaluator and should_evaluate(self.cfg.eval, step + 1, num_steps):
            with self._phase(times, "eval", step):
                evaluation = self.evaluate(step + 1)
        with self._phase({}, "metrics", step):  # asks every actor: a node lost now is a member lost, named
            memory = self.memory()
        self.resume_rollout(step, num_steps)  # async: the passes go on under the weights just synced
        record = self._record(step, times, scored, rollout_stats, train_stats, sync_stats, memory)
        if self.rt.reward_model is not None:  # its scoring this step, refills included (evaluate counts apart)
            record["reward_model"] = self.rt.reward_model.take_stats()
        if evaluation is not None:
            record["eval"] = evaluation
        self.history.append(record)
        self.first_record = self.first_record or record
        self.num_done += 1
        if self.metrics:
            self.metrics.step(record)
        return record

    # -------------------------------------------------------------------------------------------- phases

    def rollout(self, step: int) -> tuple[list[Rollout], dict]:
        """The step's groups, sampled by the policy of version `step` (the weights after `step` syncs), or by
        older ones for answers carried over (partial rollout, over-sampling). algo.mode=one_step_off: the
        previous step generated them with version step - 1 while it trained, and they wait in the pool; only
        its first step (or the first after a resume, which restored that pool) has them generated here."""
        if self.cfg.algo.mode == "async":
            if self._continuous is None:  # the first step, or the first after a resume
                self._continuous = ContinuousRollout(self.rollouts, version=step)
            groups, stats = self._continuous.take(trained_version=step)
        else:
            if not self._generated_ahead:
                self.rollouts.generate(version=step)
            self._generated_ahead = False
            groups, stats = self.rollouts.take(step)
        self.events.append("rollout")
        return groups, stats

    def start_next_rollout(self, step: int, num_steps: int) -> Background | None:
        """algo.mode=one_step_off: start generating step + 1's answers with the engines' weights (version
        `step`) in a thread of the controller's, to run while this step trains; None in sync mode or at the
        last step. The engines stay awake and the trainer resident throughout (preflight.ONE_STEP_OFF_PLAN)."""
        if self.cfg.algo.mode != "one_step_off" or step + 1 >= num_steps:
            return None
        assert not self.rt.switch.engine_sleep_level and not self.rt.switch.trainer_offload
        self.events.append("rollout.ahead")
        return Background(self.rollouts.generate, version=step, trained_version=step + 1)

    def wait_for_engines(self, ahead: Background | None, step: int) -> None:
        """Before the sync rewrites the engines' weights their generation must be over: one_step_off's next
        rollout finished, or async's pass in flight ended (and no other started until resume_rollout)."""
        if ahead is not None:
            ahead.wait()
            self._generated_ahead = True
            self.spans.append(("rollout.ahead", step, ahead.started_at, ahead.finished_at))  # ran during `step`
            self.events.append("rollout.ahead.done")
        else:
            self._continuous.pause()
            # the passes that ran since the last pause, each labelled with this step: `bench async`'s timeline
            self.spans.extend(("rollout.pass", step, *span) for span in self._continuous.drain_pass_spans())
            self.events.append("rollout.pause")

    def resume_rollout(self, step: int, num_steps: int) -> None:
        """Async, after the step's sync (and its checkpoint, evaluation and metrics, which use the engines and
        the pool alone): the passes go on with the engines' new policy, version step + 1; after the last step
        they stop."""
        if self._continuous is None:
            return
        if step + 1 < num_steps:
            self._continuous.resume(version=step + 1)
            self.events.append("rollout.resume")
        else:
            self.close()

    def close(self) -> None:
        """Stop async's passes (their thread ends when it next looks; one in flight is left to end or fail)."""
        if self._continuous is not None:
            self._continuous.close()
            self._continuous = None

    def score(self, groups: list[Rollout]) -> list[ScoredGroup]:
        scored = reward_groups(groups, reward_fn=self.reward_fn, decode=self.rt.tokenizer.decode,
                               eos_id=self.rt.tokenizer.eos_token_id, algo=self.cfg.algo,
                               turn_reward=self.cfg.rollout.turn_reward if self.cfg.rollout.env else None)
        self.events.append("score")
        return scored

    def refill(self, step: int, scored: list[ScoredGroup], rollout_stats: dict, times: dict) -> list[ScoredGroup]:
        """DAPO's dynamic sampling: while fewer than rollout.num_prompts groups have rewards that differ, roll out
        and score more prompts (at most rollout.max_refill_passes times). Each refill asks the pool for the
        missing groups over the fraction informative so far (the groups in flight decode together, so asking for
        more costs little time), at most the groups it keeps in flight. Returns every group sampled, the first
        rollout.num_prompts informative ones marked to train (rl.scoring.keep_informative); informative groups
        beyond them are surplus, reported and not trained. `rollout_stats["dynamic_sampling"]` says how it went;
        a step still short after its refills trains what it has. The refills add their passes, seconds and the
        pool's counters to `rollout_stats`; its other figures (staleness, prefix sharing, the long tail) stay
        those of the step's first collect."""
        wanted, pool = self.cfg.rollout.num_prompts, self.rollouts.pool
        num_sampled, num_refills = len(scored), 0
        while (num_kept := sum(g.informative for g in scored)) < wanted \
                and num_refills < self.cfg.rollout.max_refill_passes:
            num_refills += 1
            rate = num_kept / num_sampled
            ask = min(pool.num_in_flight, math.ceil((wanted - num_kept) / rate) if rate else pool.num_in_flight)
            with self._phase(times, "rollout", step):
                groups, stats = self.rollouts.collect(version=step, num_groups=ask, refill=True)
            with self._phase(times, "score", step):
                scored = scored + self.score(groups)
            num_sampled = len(scored)
            for key in ("num_passes", "seconds"):
                rollout_stats[key] += stats[key]
            # the pool's counters run on over a step's collects; what is carried is as the last one left it
            rollout_stats.update({k: v for k, v in stats.items() if k.startswith("num_") and k not in
                                  ("num_groups", "num_passes")})
        num_uniform, num_surplus = keep_informative(scored, wanted)
        num_kept = sum(g.trained for g in scored)
        # the staleness of what is trained, the refills' groups in and the filtered ones out
        rollout_stats.update(staleness([g.rollout for g in scored if g.trained], step))
        rollout_stats["num_groups"] = num_kept
        rollout_stats["dynamic_sampling"] = {
            "num_groups_sampled": num_sampled, "num_groups_kept": num_kept, "num_groups_uniform": num_uniform,
            "filtered_fraction": num_uniform / num_sampled, "num_groups_surplus": num_surplus,
            "num_refills": num_refills, "num_groups_short": wanted - num_kept}
        return scored

    def advantages(self, scored: list[ScoredGroup]) -> Scored:
        return Scored.from_groups(scored, algo=self.cfg.algo)

    def switch_to_train(self) -> None:
        if self.rt.switch.engine_sleep_level:
            self.rt.engines.sleep(self.rt.switch.engine_sleep_level)
            self.events.append("engine.sleep")
            if self.rt.reward_model is not None:  # asleep with the policy's engines, on their devices
                self.rt.reward_model.sleep()
                self.events.append("reward_model.sleep")
        if self.rt.switch.trainer_offload:
            self.rt.trainers.onload()
            self.events.append("trainer.onload")

    def train(self, scored: Scored, step: int) -> dict:
        total = self.rt.trainers.train_step(scored.sequences, self.cfg.trainer, step=step)
        self.events.append("train")
        monitor = mismatch_stats(torch.from_numpy(total.token_log_w), torch.from_numpy(total.seq_log_w),
                                 band=self.cfg.algo.mismatch_band)
        return {"loss": total.per_token("loss_sum"),
                "objective": total.objective,  # the loss as optimised: algo.loss_aggregation of every token's
                "lr": total.lr,  # trainer/lr_schedule.py; None: the step trained nothing
                "mismatch": total.per_token("mismatch_abs_sum"),
                "kl": total.per_token("kl_sum"),  # 0.0 with algo.kl_coef = 0
                "entropy": total.per_token("entropy_sum"),  # of the sampling distribution, per response token
                "mismatch_monitor": monitor,
                "correction": {"mode": self.cfg.algo.correction, "level": self.cfg.algo.correction_level,
                               "fraction_affected": total.per_token("corrected_sum"),
                               "weight_mean": total.per_token("weight_sum")},
                "clip_fraction": total.per_token("clipped_sum"),
                "grad_norm": total.grad_norm or 0.0}

    def switch_to_sync(self) -> None:
        self.rt.trainers.release_grads()
        self.events.append("trainer.release_grads")
        if self.rt.switch.engine_sleep_level:
            self.rt.engines.wake(["weights"])
            self.events.append("engine.wake.weights")

    def sync(self) -> dict:
        stats = self.rt.sync.run()
        if self.cfg.sync.verify == "full":
            mismatched = self.rt.sync.verify_full(self.cfg.engine.dtype)
            if mismatched:
                raise RuntimeError(f"weight sync verification failed: {len(mismatched)} engine tensor(s) differ "
                                   f"from the trainer's, e.g. {mismatched[0]}")
        self.events.append("sync")
        return stats

    def switch_to_rollout(self) -> None:
        if self.rt.switch.trainer_offload:
            self.rt.trainers.offload()
            self.events.append("trainer.offload")
        if self.rt.switch.engine_sleep_level:
            self.rt.engines.wake(["kv_cache"])
            self.events.append("engine.wake.kv_cache")
            if self.rt.reward_model is not None:  # awake for the next step's scoring, and for evaluation
                self.rt.reward_model.wake()
                self.events.append("reward_model.wake")

    def evaluate(self, num_done: int) -> dict:
        """pass@k of the policy the engines hold now (awake: between steps, or before the first), after
        `num_done` steps; every answer goes to <output_dir>/eval/after_<num_done>_steps.jsonl."""
        reward_model = self.rt.reward_model
        # the reward model's work for the evaluation is counted apart from the step's scoring (its own record)
        with reward_model.separate_stats() if reward_model else contextlib.nullcontext({}) as reward_model_stats:
            result = self.evaluator.run()
        if reward_model is not None:
            result["reward_model"] = reward_model_stats
        self.events.append("eval")
        out = Path(self.cfg.logging.output_dir) / "eval"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"after_{num_done}_steps.jsonl", "w") as f:
            f.writelines(json.dumps(a) + "\n" for a in self.evaluator.last_answers)
        return result

    # ----------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int) -> None:
        """After the sync, before the trainer leaves the device: its state is where a save reads it, and the
        controller's (data place, groups in flight) is exactly that after `step`."""
        path = self.checkpointer.save(step, self.rt.trainers, self.checkpoint_state(step))
        self.events.append("checkpoint")
        if self.metrics:
            self.metrics.write({"event": "checkpoint", "step": step, "path": str(path)})

    def checkpoint_state(self, step: int) -> dict:
        """The controller's part of a checkpoint after `step` (JSON): the data place and the groups in flight,
        and whether the pool's complete groups were generated ahead for the next step (one_step_off): a resumed
        run must take them as they are, not add a pass with its own version first (with partial rollout the
        pool may hold fewer than a step's groups)."""
        return {"step": step, "rollouts": self.rollouts.state(), "generated_ahead": self._generated_ahead}

    def load_checkpoint_state(self, state: dict) -> None:
        self.rollouts.load_state(state["rollouts"])
        self._generated_ahead = state.get("generated_ahead", False)  # absent: a checkpoint of a sync-mode release

    def restore(self, path: Path) -> int:
        """Load a checkpoint into the trainers and the controller, then sync the loaded weights into the engines
        (they started from model.path). Returns the first step to run. Runs before the first switch: the trainers
        are on the device and the engines awake, as after start-up."""
        state = self.checkpointer.load(path, self.rt.trainers)
        self.load_checkpoint_state(state)
        self.sync()
        self.events.append("restore")
        if self.metrics:
            self.metrics.write({"event": "resume", "path": str(path), "step": state["step"]})
        return state["step"] + 1

    # ------------------------------------------------------------------------------------------- helpers

    @contextlib.contextmanager
    def _phase(self, times: dict, name: str, step: int | None = None):
        """Adds the block's wall time to times[name] (the three switches of a step add up), under the
        watchdog's eye: a member that dies or hangs in it becomes a JobFault naming it."""
        started = time.perf_counter()
        try:
            with self.watchdog.phase(name, step) if self.watchdog else contextlib.nullcontext():
                yield
        finally:
            ended = time.perf_counter()
            times[name] = times.get(name, 0.0) + ended - started
            self.spans.append((name, step, started, ended))

    def _record(self, step: int, times: dict, scored: Scored, rollout_stats: dict, train_stats: dict,
                sync_stats: dict, memory: dict) -> dict:
        stats = scored.stats()
        return {
            "step": step,
            **stats,
            "rollout": rollout_stats,
            **train_stats,
            **sync_stats,
            # over the generating time: the rollout phase's in sync mode (which holds the passes), the passes' own
            # in one_step_off (they ran during the previous step's training)
            "rollout_tokens_per_s": stats["num_response_tokens"] / max(times["rollout"], rollout_stats["seconds"]),
            "times": times,
            "memory": memory,
            "sample": {"response": scored.responses[0]},
        }

    def memory(self) -> dict:
        """Host RSS summed per side, and on CUDA each actor's device memory (torch's allocated and reserved
        bytes, and the driver's free bytes on its GPU: vLLM's cuMem pool is invisible to torch's counters)."""
        engines = [w for e in self.rt.engines.call("memory") for w in e]
        trainers = self.rt.trainers.call("memory")
        record = {"engine_rss_bytes": sum(w["rss_bytes"] for w in engines),
                  "trainer_rss_bytes": sum(t["rss_bytes"] for t in trainers)}
        if self.rt.reward_model is not None:
            record["reward_model_rss_bytes"] = sum(w["rss_bytes"] for w in self.rt.reward_model.memory())
        if "device_free_bytes" in trainers[0]:
            keys = ("device_allocated_bytes", "device_reserved_bytes", "device_free_bytes")
            record["trainers"] = [{k: t[k] for k in keys} for t in trainers]
            record["engine_workers"] = [{k: w[k] for k in keys} for w in engines]
        return record
