"""This machine's CPU as a model, from a Calibration (`colocate simulate --calibrate`): the decode step, prefill
and train step read off the measured tables, the switch and the sync as measured; the rollout played by the same
simulation the GPU model uses (simulate/rollout.py), so only the constants differ.

    cal = Calibration.load(path)
    engine = CpuEngine(cal)
    engine.step_s(running=32, context=32 * 60)    # interpolated by batch size, the measured context term
    predict_rollout_modes(cal, cfg, modes=bench_rollout.MODES, num_steps=5)   # bench rollout's work, per mode

Assumptions, each a line of docs/simulate.md:
- the decode step at a batch size between two measured ones is linear between them; past the largest, linear in
  the batch from the last two (a CPU is compute-bound well before 64 sequences, so the step grows with the batch);
- the context term is the measured slope between a batch's early and late steps, zero where it came out negative
  (noise on a 2-core machine);
- prefill is the measured seconds per prompt token, with no prefix sharing (vLLM's CPU KV block is 128 tokens,
  longer than the benchmark's prompts, so a group's samples share no full block);
- the train step is linear in the step's tokens between the measured points (and beyond, from the last two);
- scoring is not modelled (a char-match reward over short answers: milliseconds);
- overlapped modes (one_step_off, async; split too: on one machine its "devices" are the same cores): the engine
  and the trainers run at once at the gain the calibration measured (a decode pass beside a train step, over the
  two alone: Calibration.overlap_gain), the step phases.overlapped_s of the two sides' work alone;
- async's step is the passes it takes to complete rollout.num_prompts groups (Rounds.per_step);
- the switch is the one the calibration measured: the job it calibrated, with its sleep level and offload.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass
from functools import cached_property

from colocate.config import JobConfig
from colocate.simulate.hardware import Calibration
from colocate.simulate.phases import Work, overlapped_s
from colocate.simulate.rollout import WARMUP_STEPS, Rounds, RolloutSim

CPU_KV_BLOCK_TOKENS = 128


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear through the points, extended from the two nearest at either end."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0


@dataclass(frozen=True)
class CpuEngine:
    """One engine of this machine: what RolloutSim asks of an engine (step_s, prefill_s, resume_s, pass_s,
    kv_capacity_tokens)."""

    cal: Calibration
    num_samples: int = 1

    @cached_property  # read once: step_s runs for every simulated decode step
    def _table(self) -> tuple[list[int], list[float], list[float], list[float]]:
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for running, context, seconds in self.cal.decode_step_s:
            by_batch.setdefault(running, []).append((context, seconds))
        batches, base, mid, slope = [], [], [], []
        for b in sorted(by_batch):
            rows = sorted(by_batch[b])
            (c0, s0), (c1, s1) = rows[0], rows[-1]
            batches.append(b)
            base.append(statistics.fmean(s for _, s in rows))
            mid.append(statistics.fmean(c for c, _ in rows))
            slope.append(max(0.0, (s1 - s0) / (c1 - c0)) if c1 > c0 else 0.0)
        return batches, base, mid, slope

    def step_s(self, running: int, context: int) -> float:
        if running <= 0:
            return 0.0
        batches, base, mid, slope = self._table
        at = _interp(batches, base, running)
        return max(at + _interp(batches, slope, running) * (context - _interp(batches, mid, running)), 0.1 * at)

    def prefill_s(self, num_tokens: int) -> float:
        """`num_tokens`: a prompt's tokens per new group (RolloutSim counts a group's prompt once); on the CPU a
        prompt shorter than a KV block is computed once per sample."""
        shared = self.cal.prompt_tokens >= CPU_KV_BLOCK_TOKENS
        return self.cal.prefill_s_per_token * num_tokens * (1 if shared else self.num_samples)

    def resume_s(self, num_tokens: int) -> float:
        """`num_tokens`: the contexts (prompt and tokens so far) of continued answers, each its own."""
        return self.cal.prefill_s_per_token * num_tokens

    @property
    def pass_s(self) -> float:
        """A pass's cost beside its steps (the call, its requests in and results out), as measured."""
        return self.cal.pass_s

    @property
    def kv_capacity_tokens(self) -> int:
        return 1 << 40  # the benchmark's engine.kv_cache_gib holds every running context: not the limit here


def train_step_s(cal: Calibration, tokens: float) -> float:
    rows = sorted(cal.train_step_s)
    return max(0.0, _interp([t for t, _ in rows], [s for _, s in rows], tokens))


def cpu_work(cal: Calibration, cfg: JobConfig) -> Work:
    """The Work RolloutSim reads (groups, samples, the concurrency limit, the prompt): the model's dimensions are
    in the measured tables instead."""
    return Work(params=0.0, active_params=0.0, embedding_params=0.0, layers=0, hidden=0, attention_width=0,
                kv_bytes_per_token=0.0, prompt_tokens=cal.prompt_tokens, num_groups=cfg.rollout.num_prompts,
                num_samples=cfg.rollout.num_samples, max_num_seqs=cfg.engine.max_num_seqs or cal.max_num_seqs)


def predict_rollout(cal: Calibration, cfg: JobConfig, draw, *, num_steps: int, partial_tokens: int = 0,
                    oversample: float = 1.0, max_lag: int = 1, leftover: str = "carry", whole: bool = False) -> dict:
    """One mode's steady state: rollout seconds and the step (rollout, switch, train, sync in turn), over
    `num_steps` after the warm-up the measurement also drops. Over-sampling with `leftover=drop` starts every
    step afresh (nothing carried), so each step is its own one-step simulation. `whole`: a step is the passes
    that complete rollout.num_prompts groups (algo.mode=async), not one pass (partial rollout)."""
    work, engine = cpu_work(cal, cfg), CpuEngine(cal, num_samples=cfg.rollout.num_samples)

    def sim() -> RolloutSim:
        return RolloutSim(work, engine, num_engines=max(1, cal.num_engines), draw=draw,
                          partial_tokens=partial_tokens, oversample=oversample, max_lag=max_lag, take_whole=whole)

    if oversample > 1 and leftover == "drop":
        rounds = Rounds([sim().run(1).steps[0] for _ in range(num_steps + 1)][1:], warmup_steps=0)
    else:  # carried answers build up first: the warm-up steps are left out, as the measurement leaves them
        rounds = sim().run(num_steps + WARMUP_STEPS)

    rollout, trained = rounds.per_step("seconds"), rounds.per_step("trained_tokens")
    # the switch the calibration measured: its job's own sleep level and offload (the halves are ~0 without)
    phases = {"rollout": rollout, "switch": cal.switch_s.get("seconds", 0.0), "train": train_step_s(cal, trained),
              "sync": cal.sync_s}
    return {"rollout_s": rollout, "step_s": sum(phases.values()), "phases": phases, "trained_tokens": trained,
            "decoded_tokens": rounds.per_step("decoded_tokens")}


def overlapped_step_s(cal: Calibration, phases: dict[str, float]) -> float:
    """An overlapped mode on this machine: the rollout beside the trainers' side (switch, train, sync), at the
    gain the calibration measured for running both at once."""
    return overlapped_s(phases["rollout"], phases["switch"] + phases["train"] + phases["sync"], cal.overlap_gain)
