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

The rollout is one object per algo.mode (rollout/modes.py), with the same face in every mode: `take` a step's
groups, `before_train`, `before_sync`, `after_sync`. algo.mode=one_step_off generates step k + 1's answers while
step k trains and waits for them before the sync; algo.mode=async runs rollout passes without pause and pauses
them for the sync alone (docs/async.md). Nothing sleeps or moves in those modes. algo.dynamic_sampling's refill
(rollout/refill.py) rolls out and scores more until enough groups have rewards that differ.

After the sync, when due: evaluation on the validation prompts (rollout.evaluation, the same engines, awake) and a
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
from collections import deque
from pathlib import Path

from colocate.checkpoint.checkpointer import Checkpointer
from colocate.config import JobConfig
from colocate.job.engine_restarts import EngineRestarts
from colocate.job.faults import Watchdog
from colocate.job.groups import memory_record
from colocate.job.rollout_dump import RolloutDump
from colocate.job.runtime import Runtime
from colocate.job.updates import PolicyUpdate
from colocate.rl.data import PromptSource, make_prompt_source
from colocate.rl.rewards import make_reward
from colocate.rl.samples import Group
from colocate.rl.scoring import Scored, ScoredGroup, reward_groups
from colocate.rollout.evaluation import make_evaluator, should_evaluate
from colocate.rollout.modes import make_rollout
from colocate.rollout.passes import Passes
from colocate.rollout.refill import make_sampling
from colocate.telemetry.metrics import MetricsWriter
from colocate.telemetry.trace import HISTORY_KEPT, Trace


class Controller:
    def __init__(self, cfg: JobConfig, runtime: Runtime, metrics: MetricsWriter | None = None,
                 rollouts: Passes | None = None, prompts: PromptSource | None = None,
                 resume_from: Path | None = None):
        """`rollouts`: the passes over the engines (a test's, a bench's); by default built here over `prompts`, a
        source built (and its files checked) before the runtime started, or one of data.train_files or the toy
        task. `resume_from`: a checkpoint checked against the job (checkpoint.resume_point) to continue from."""
        self.cfg = cfg
        self.rt = runtime
        self.metrics = metrics
        self.task = runtime.setup.task  # built once per job, in the driver (job/setup.py)
        self.reward_fn = make_reward(cfg, self.task, runtime.reward_model)
        self.trace = Trace()
        self.events, self.spans = self.trace.events, self.trace.spans  # the switching order; `bench async`'s timeline
        self.passes = rollouts or Passes(cfg, runtime.engines, runtime.tokenizer,
                                         prompts or make_prompt_source(cfg, runtime.tokenizer, self.task),
                                         env_workers=runtime.env_workers)
        self.rollout = make_rollout(cfg, self.passes, self.trace, runtime.switch)
        # fault.engine_restarts: the phases where the engines work, run again once a failed engine is replaced
        self.restarts = EngineRestarts(cfg, runtime, self.trace, metrics=metrics,
                                       in_flight=lambda engine: self.passes.regenerated(engine))
        self.passes.engine_wait = self.restarts.engine_wait  # where a fault may cut a rollout short
        self.update = PolicyUpdate(runtime, cfg)  # mini-batches, epochs, the proximal policy
        self.dump = RolloutDump(cfg.logging)  # logging.rollouts
        self.sampling = make_sampling(cfg, self.rollout, lambda groups: self.score(groups), self.trace,
                                      run_phase=self.restarts.run)
        self.evaluator = make_evaluator(cfg, runtime.engines, runtime.tokenizer, self.reward_fn, self.task)
        self.checkpointer = Checkpointer(cfg, runtime.model_path)
        self.resume_from = resume_from
        self.history: deque[dict] = deque(maxlen=HISTORY_KEPT)  # the newest step records
        self.first_record: dict | None = None
        self.num_done = 0  # steps finished by this controller

    @property
    def watchdog(self) -> Watchdog | None:
        """run() watches the actors; a test's step() alone does not."""
        return self.trace.watchdog

    @watchdog.setter
    def watchdog(self, watchdog) -> None:
        self.trace.watchdog = watchdog

    def run(self) -> list[dict]:
        with Watchdog(self.cfg.fault, self.rt) as self.watchdog:
            try:
                first = 0
                if self.resume_from:
                    with self.trace.phase("restore", timed=False):
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
            result = self.restarts.run("eval", None, lambda: self.evaluate(0), timed=False)
            if self.metrics:
                self.metrics.evaluation(result, num_done=0)
        if self.rt.switch.trainer_offload:
            with self.trace.phase("switch", timed=False):
                self.rt.trainers.offload()  # the engine runs first
            self.trace.event("trainer.offload")
        for step in range(first, num_steps):
            self.step(step, num_steps=num_steps)
        return list(self.history)

    def step(self, step: int, *, num_steps: int | None = None) -> dict:
        num_steps = num_steps or self.cfg.algo.num_steps
        phase, times = self.trace.phase, self.trace.new_step()
        groups, rollout_stats = self.restarts.run("rollout", step, lambda: self.rollout.take(step))
        with phase("score", step):
            scored_groups = self.score(groups)
        scored_groups, rollout_stats = self.sampling.refill(step, scored_groups, rollout_stats)
        scored = self.advantages(scored_groups)
        self.rollout.before_train(step, num_steps)  # one_step_off: the engines generate step + 1's answers
        with phase("switch", step):
            self.switch_to_train()
        with phase("train", step):
            train_stats = self.train(scored, step)
        with phase("switch", step):
            self.switch_to_sync()
        self.rollout.before_sync(step)  # the engines' generation is over before the sync rewrites their weights
        with phase("sync", step):
            sync_stats = self.sync()
        self.rollout.after_update(step, num_steps)  # async with rollout.update_in_pass: the parked pass goes on
        if self.checkpointer.due(step + 1, num_steps):
            with phase("checkpoint", step):
                self.save_checkpoint(step)
        with phase("switch", step):
            self.switch_to_rollout()
        evaluation = None
        if self.evaluator and should_evaluate(self.cfg.eval, step + 1, num_steps):
            evaluation = self.restarts.run("eval", step, lambda: self.evaluate(step + 1))
        with phase("metrics", step, timed=False):  # asks every actor: a node lost now is a member lost, named
            memory = memory_record(self.rt.engines, self.rt.trainers, self.rt.reward_model)
        self.rollout.after_sync(step, num_steps)  # async: the passes go on under the weights just synced
        return self._finish(step, times, scored, rollout_stats, train_stats, sync_stats, memory, evaluation)

    def close(self) -> None:
        """Stop what the rollout runs beside the steps (async's passes)."""
        self.rollout.close()

    # -------------------------------------------------------------------------------------------- phases

    def score(self, groups: list[Group]) -> list[ScoredGroup]:
        scored = reward_groups(groups, reward_fn=self.reward_fn, decode=self.rt.tokenizer.decode,
                               eos_id=self.rt.tokenizer.eos_token_id, algo=self.cfg.algo,
                               turn_reward=self.cfg.rollout.turn_reward if self.cfg.rollout.env else None)
        self.trace.event("score")
        return scored

    def advantages(self, scored: list[ScoredGroup]) -> Scored:
        return Scored.from_groups(scored, algo=self.cfg.algo)

    def switch_to_train(self) -> None:
        if self.rt.switch.engine_sleep_level:
            self.rt.engines.sleep(self.rt.switch.engine_sleep_level)  # and what sleeps with them (a reward model)
            self.trace.event("engine.sleep")
        if self.rt.switch.trainer_offload:
            self.rt.trainers.onload()
            self.trace.event("trainer.onload")

    def train(self, scored: Scored, step: int) -> dict:
        sequences = self.update.prepare(scored.sequences)  # the proximal policy, the critic's values: once
        self.dump.write(step, scored, sequences, self.rt.trainers, self.cfg)  # before the update
        total = self.update.train(sequences, step=step)
        self.trace.event("train")
        return total.record(self.cfg.algo)

    def switch_to_sync(self) -> None:
        self.rt.trainers.release_grads()
        self.trace.event("trainer.release_grads")
        if self.rt.switch.engine_sleep_level:
            self.rt.engines.wake(["weights"])
            self.trace.event("engine.wake.weights")

    def sync(self) -> dict:
        stats = self.rt.sync.run()
        if self.cfg.sync.verify == "full":
            mismatched = self.rt.sync.verify_full(self.cfg.engine.dtype)
            if mismatched:
                raise RuntimeError(f"weight sync verification failed: {len(mismatched)} engine tensor(s) differ "
                                   f"from the trainer's, e.g. {mismatched[0]}")
        self.trace.event("sync")
        return stats

    def switch_to_rollout(self) -> None:
        if self.rt.switch.trainer_offload:
            self.rt.trainers.offload()
            self.trace.event("trainer.offload")
        if self.rt.switch.engine_sleep_level:
            self.rt.engines.wake(["kv_cache"])  # and what sleeps with them, whole: for scoring and evaluation
            self.trace.event("engine.wake.kv_cache")

    def evaluate(self, num_done: int) -> dict:
        """pass@k of the policy the engines hold now (awake: between steps, or before the first), after
        `num_done` steps; every answer goes to <output_dir>/eval/after_<num_done>_steps.jsonl."""
        reward_model = self.rt.reward_model
        # the reward model's work for the evaluation is counted apart from the step's scoring (its own record)
        with reward_model.separate_stats() if reward_model else contextlib.nullcontext({}) as reward_model_stats:
            result = self.evaluator.run()
        if reward_model is not None:
            result["reward_model"] = reward_model_stats
        self.trace.event("eval")
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
        self.trace.event("checkpoint")
        if self.metrics:
            self.metrics.write({"event": "checkpoint", "step": step, "path": str(path)})

    def checkpoint_state(self, step: int) -> dict:
        """The controller's part of a checkpoint after `step` (JSON): the rollout's (the data place, the groups in
        flight, whether the pool's complete groups were generated ahead for the next step)."""
        return {"step": step, **self.rollout.state()}

    def load_checkpoint_state(self, state: dict) -> None:
        self.rollout.load_state(state)

    def restore(self, path: Path) -> int:
        """Load a checkpoint into the trainers and the controller, then sync the loaded weights into the engines
        (they started from model.path). Returns the first step to run. Runs before the first switch: the trainers
        are on the device and the engines awake, as after start-up."""
        state = self.checkpointer.load(path, self.rt.trainers)
        self.load_checkpoint_state(state)
        self.dump.resume(after_step=state["step"])  # the steps after it are trained again
        self.sync()
        self.trace.event("restore")
        if self.metrics:
            self.metrics.write({"event": "resume", "path": str(path), "step": state["step"]})
        return state["step"] + 1

    # ------------------------------------------------------------------------------------------- helpers

    def _finish(self, step: int, times: dict, scored: Scored, rollout_stats: dict, train_stats: dict,
                sync_stats: dict, memory: dict, evaluation: dict | None) -> dict:
        """The step's record: kept (the newest), counted, and written to the metrics."""
        stats = scored.stats()
        record = {
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
        if self.rt.reward_model is not None:  # its scoring this step, refills included (evaluate counts apart)
            record["reward_model"] = self.rt.reward_model.take_stats()
        if evaluation is not None:
            record["eval"] = evaluation
        if restarts := self.restarts.take_events():  # fault.engine_restarts: the engines replaced this step
            record["engine_restarts"] = restarts
        self.history.append(record)
        self.first_record = self.first_record or record
        self.num_done += 1
        if self.metrics:
            self.metrics.step(record)
        return record
