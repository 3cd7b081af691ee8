"""One rollout driver per algo.mode, all with the same face: the controller holds one and never asks which runs.

    rollout = make_rollout(cfg, passes, trace, switch)   # passes: rollout/passes.py, over the engines and the pool
    groups, stats = rollout.take(step)       # the step's complete groups: sampled by policy `step`, or older
    rollout.before_train(step, num_steps)    # one_step_off: step + 1's answers start generating
    ...                                      # score, train: the engines may still be generating
    rollout.before_sync(step)                # their generation is over (a watched "rollout_wait" when it waits)
    ...                                      # sync
    rollout.after_update(step, num_steps)    # async with rollout.update_in_pass: the parked pass goes on
    ...                                      # checkpoint, evaluation: the engines and the pool are idle (in-pass
                                             # updates: the pass goes on, and an evaluation waits for it to end)
    rollout.after_sync(step, num_steps)      # async: the passes go on under the weights just synced
    state = rollout.state(); rollout.load_state(state)   # a checkpoint's part (JSON)
    rollout.close()

A new mode is a class here with these methods, named in MODES and in config/algo.py's valid modes (its switch
plan, when it keeps the engines busy during training, is job/preflight.py's); job/controller.py is not touched.

- sync (`RolloutMode`): each step generates its own groups when it takes them; nothing happens between.
- one_step_off (docs/async.md): step k + 1's answers are generated with the weights of version k in a thread
  (rollout/overlap.py `Background`) while step k trains; the sync waits for them.
- async: rollout passes run back to back in a thread (rollout/overlap.py `ContinuousRollout`); a step takes
  complete groups from it, and its sync waits only for the pass in flight (pause, sync, resume).
- async with rollout.update_in_pass (`InPassRollout`): the sync does not wait for the pass; the engines park it
  between two steps, and it goes on under the new weights (engine/pass_gate.py). With rollout.stream the passes
  take new requests as they run and hand back each answer as it ends (rollout/streaming.py).
"""

from __future__ import annotations

import contextlib

import ray

from colocate.config import JobConfig
from colocate.config.algo import OVERLAPPED_MODES
from colocate.rl.samples import Group
from colocate.rollout.overlap import Background, ContinuousRollout
from colocate.rollout.passes import Passes
from colocate.rollout.streaming import StreamingRollout


class RolloutMode:
    """algo.mode=sync, and what every mode shares: the passes, the trace, the checkpoint's part."""

    def __init__(self, passes: Passes, trace):
        self.passes, self.trace = passes, trace

    def take(self, step: int) -> tuple[list[Group], dict]:
        """The step's groups, sampled by the policy of version `step` (the weights after `step` syncs), or by older
        ones for answers carried over (partial rollout, over-sampling, a mode that generates ahead)."""
        groups, stats = self._take(step)
        self.trace.event("rollout")
        return groups, stats

    def _take(self, step: int) -> tuple[list[Group], dict]:
        self.passes.generate(version=step)
        return self.passes.take(step)

    def take_more(self, step: int, num_groups: int) -> tuple[list[Group], dict]:
        """Dynamic sampling's refill (rollout/refill.py): `num_groups` more complete groups for step `step`, their
        stats counted on from the step's take (the pool's counters run on). Here a collect of their own: before
        the step trains, the engines are the main thread's in sync and one_step_off alike."""
        return self.passes.collect(version=step, num_groups=num_groups, refill=True)

    def before_train(self, step: int, num_steps: int) -> None:
        pass

    def before_sync(self, step: int) -> None:
        pass

    def after_update(self, step: int, num_steps: int) -> None:
        pass

    def after_sync(self, step: int, num_steps: int) -> None:
        pass

    def state(self) -> dict:
        """Where the prompts are and what is in flight (JSON). `generated_ahead`: a resumed one_step_off run must
        take the pool's complete groups as they are; the key is kept in every mode's checkpoint."""
        return {"rollouts": self.passes.state(), "generated_ahead": False}

    def load_state(self, state: dict) -> None:
        self.passes.load_state(state["rollouts"])

    def close(self) -> None:
        pass


class OneStepOffRollout(RolloutMode):
    """Step k trains what step k - 1 generated ahead with version k - 1; only the first step (or the first after a
    resume, which restored that pool) generates its own. The engines stay awake and the trainer resident
    throughout (preflight.ONE_STEP_OFF_PLAN)."""

    def __init__(self, passes: Passes, trace):
        super().__init__(passes, trace)
        self._generated_ahead = False  # the pool holds the next step's groups, generated ahead
        self._ahead: Background | None = None

    def _take(self, step: int) -> tuple[list[Group], dict]:
        if not self._generated_ahead:
            self.passes.generate(version=step)
        self._generated_ahead = False
        return self.passes.take(step)

    def before_train(self, step: int, num_steps: int) -> None:
        """Start generating step + 1's answers with the engines' weights (version `step`) in a thread, to run
        while this step trains; nothing at the last step."""
        if step + 1 >= num_steps:
            return
        self.trace.event("rollout.ahead")
        self._ahead = Background(self.passes.generate, version=step, trained_version=step + 1)

    def before_sync(self, step: int) -> None:
        """Before the sync rewrites the engines' weights, the next step's generation must be over."""
        if self._ahead is None:
            return
        ahead, self._ahead = self._ahead, None
        with self.trace.phase("rollout_wait", step):  # the trainer idles until the engines are done
            ahead.wait()
        self._generated_ahead = True
        self.trace.spans.append(("rollout.ahead", step, ahead.started_at, ahead.finished_at))  # ran during `step`
        self.trace.event("rollout.ahead.done")

    def state(self) -> dict:
        return {**super().state(), "generated_ahead": self._generated_ahead}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self._generated_ahead = state.get("generated_ahead", False)  # absent: a checkpoint of a sync-mode release


class AsyncRollout(RolloutMode):
    """The passes run without pause in their own thread, started by the first take (of the run, or after a
    resume); a step takes complete groups that its policy may train (within rollout.max_lag)."""

    continuous: type[ContinuousRollout] = ContinuousRollout  # what runs the passes

    def __init__(self, passes: Passes, trace):
        super().__init__(passes, trace)
        self._continuous: ContinuousRollout | None = None
        self._counted: dict[str, int] = {}  # the pool's counters of the step's takes so far

    def _take(self, step: int) -> tuple[list[Group], dict]:
        if self._continuous is None:
            self._continuous = self.continuous(self.passes, version=step)
        groups, stats = self._continuous.take(trained_version=step)
        self._counted = _counters(stats)
        return groups, stats

    def take_more(self, step: int, num_groups: int) -> tuple[list[Group], dict]:
        """The refill's groups come from the passes that run on the engines anyway, as a step's take does: never
        a rollout of the main thread's beside them (the pool is theirs)."""
        groups, more = self._continuous.take(trained_version=step, num_groups=num_groups)
        # a take resets the pool's counters (each step counts the passes since the last): carried on here
        for key, value in self._counted.items():
            more[key] += value
        self._counted = _counters(more)
        return groups, more

    def before_sync(self, step: int) -> None:
        """The pass in flight ends, and no other starts until after_sync."""
        with self.trace.phase("rollout_wait", step):
            self._continuous.pause()
        # the passes that ran since the last pause, each labelled with this step: `bench async`'s timeline
        self.trace.spans.extend(("rollout.pass", step, *span) for span in self._continuous.drain_pass_spans())
        self.trace.event("rollout.pause")

    def after_sync(self, step: int, num_steps: int) -> None:
        """After the step's sync (and its checkpoint, evaluation and metrics, which use the engines and the pool
        alone): the passes go on with the engines' new policy, version step + 1; after the last step they stop."""
        if step + 1 < num_steps:
            self._continuous.resume(version=step + 1)
            self.trace.event("rollout.resume")
        else:
            self.close()

    def close(self) -> None:
        """Stop the passes (their thread ends when it next looks; one in flight is left to end or fail)."""
        if self._continuous is not None:
            self._continuous.close()
            self._continuous = None


class InPassRollout(AsyncRollout):
    """algo.mode=async with rollout.update_in_pass: the update does not wait for the pass in flight. The engines
    park it between two engine steps (engine/pass_gate.py), the sync writes the new weights, and the pass goes on
    under them; its later tokens are tagged with the new version. The update's wait is about one decode step.
    `stream` (rollout.stream): the passes take requests as they run and hand back each answer as it ends
    (rollout/streaming.py), so a step takes its groups without waiting for a pass to end."""

    def __init__(self, passes: Passes, trace, kv: str, *, stream: bool = False):
        super().__init__(passes, trace)
        if stream:
            self.continuous = StreamingRollout
        self.kv = kv  # keep or recompute the KV cache of the answers in flight
        self._holding: int | None = None  # the version the engines hold while parked for an update

    def before_sync(self, step: int) -> None:
        """No pass starts; the one in flight parks in every engine (each returns between two of its steps)."""
        with self.trace.phase("rollout_wait", step):
            self._continuous.hold()
            self._holding = step
            parked = ray.get([e.pause_pass.remote() for e in self.passes.engines])
        self.trace.event("rollout.park" if any(parked) else "rollout.pause")

    def after_update(self, step: int, num_steps: int) -> None:
        """Right after the sync: the parked pass goes on under version step + 1, and the next passes are planned
        under it. After the last step the pass in flight ends at its next step (its answers keep their tokens)."""
        last = step + 1 >= num_steps
        # watched as rollout_wait (bounded by fault.rollout_timeout_s, a lost engine named): the resume, and after
        # the last step the wait for the pass in flight to end
        with self.trace.phase("rollout_wait", step):
            ray.get([e.resume_pass.remote(step + 1, self.kv, last) for e in self.passes.engines])
            self._holding = None
            if last:
                self._continuous.pause()  # the pass in flight ends at its next engine step; none starts after it
        self.trace.spans.extend(("rollout.pass", step, *span) for span in self._continuous.drain_pass_spans())
        if last:
            self.close()
        else:
            self._continuous.release(version=step + 1)
            self.trace.event("rollout.resume")

    def close(self) -> None:
        """A step that failed between the park and the update leaves the pass parked: it ends (an engine's default
        thread would otherwise wait on it, and its shutdown behind it)."""
        if self._holding is not None:
            version, self._holding = self._holding, None
            with contextlib.suppress(Exception):  # an engine lost in the failure: its own error is the job's
                ray.get([e.resume_pass.remote(version, self.kv, True) for e in self.passes.engines], timeout=30)
        super().close()

    def after_sync(self, step: int, num_steps: int) -> None:
        pass  # the passes went on at after_update

    def state(self) -> dict:
        """Read as no pass's results change the pool: a pass may be in flight (its answers are saved as it found
        them, and a resumed run continues them from there)."""
        with self._continuous.locked() if self._continuous else contextlib.nullcontext():
            return super().state()


def _counters(stats: dict) -> dict[str, int]:
    """The pool's counters in a take's stats (rollout/passes.py `_stats`), which dynamic sampling's refills add
    to the step's."""
    return {k: stats[k] for k in ("num_tokens_generated", "num_aborted", "num_lag_restarts", "num_dropped_groups",
                                  "num_env_dropped") if k in stats}


MODES: dict[str, type[RolloutMode]] = {"sync": RolloutMode, "one_step_off": OneStepOffRollout,
                                       "async": AsyncRollout}


def make_rollout(cfg: JobConfig, passes: Passes, trace, switch) -> RolloutMode:
    """The driver of cfg.algo.mode (algo.mode=async with rollout.update_in_pass: InPassRollout). `switch`: the
    runtime's switch plan; a mode that generates while the trainer works (config.algo.OVERLAPPED_MODES, which the
    preflight gives a fixed plan) needs both sides where they are."""
    assert cfg.algo.mode not in OVERLAPPED_MODES or not (switch.engine_sleep_level or switch.trainer_offload), \
        f"algo.mode={cfg.algo.mode} with a switch plan that moves memory: {switch}"
    if cfg.algo.mode == "async" and cfg.rollout.update_in_pass != "never":
        return InPassRollout(passes, trace, cfg.rollout.update_in_pass, stream=cfg.rollout.stream)
    return MODES[cfg.algo.mode](passes, trace)
