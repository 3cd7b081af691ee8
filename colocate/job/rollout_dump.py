"""Rollout dumps (logging.rollouts): what each step trained on, one JSON line an answer, in rollouts.jsonl beside
metrics.jsonl, for a user to read back.

    dump = RolloutDump(cfg.logging)
    dump.write(step, scored, prepared, trainers, cfg)   # before the update: the trainer's log-probs the policy's
    read_rollouts(path)                             # the lines, as dicts

A line: the step, the group's place among the step's groups and the answer's in its group, the prompt (text
and ids), the answer (text and ids), its reward, advantage and finish reason, the policy version that sampled
each token, and per answer token the engine's sampling log-prob and the trainer's before the step's update (the
proximal policy's where the update recomputed it, job/updates.py; else one no-grad forward of the dumped answers:
the loss's path, TrainerGroup.score), with a multi-turn answer's mask; with algo.advantage=gae also each token's
advantage (as trained: whitened), return and the critic's value.
The first logging.rollouts trained groups of each step are dumped (-1: all), until the file holds
logging.rollouts_max_mb; then one line says it stopped. A resumed run first cuts the lines of the steps after
its checkpoint (they are trained again).
"""

from __future__ import annotations

import json
from pathlib import Path

from colocate.config import JobConfig, LoggingConfig
from colocate.rl.scoring import Scored

FILE = "rollouts.jsonl"


def read_rollouts(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class RolloutDump:
    def __init__(self, cfg: LoggingConfig) -> None:
        self.cfg = cfg
        self.path = Path(cfg.output_dir) / FILE
        self.full = self.path.exists() and self.path.stat().st_size >= self._limit

    @property
    def on(self) -> bool:
        return self.cfg.rollouts != 0 and not self.full

    @property
    def _limit(self) -> int:
        return int(self.cfg.rollouts_max_mb * 2**20)

    def resume(self, after_step: int) -> None:
        """A resumed run: drop the lines of steps after `after_step` (and a torn last line)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", -1) <= after_step and "event" not in record:
                kept.append(line)
        self.path.write_text("".join(f"{line}\n" for line in kept))
        self.full = self.path.stat().st_size >= self._limit

    def write(self, step: int, scored: Scored, prepared: list, trainers, cfg: JobConfig) -> None:
        """`prepared`: scored.sequences as the update prepared them (PolicyUpdate.prepare), in the same order."""
        if not self.on or not scored.sequences:
            return
        places = sorted({place for place, _ in scored.origins})
        if self.cfg.rollouts > 0:
            places = places[:self.cfg.rollouts]
        chosen = [(s, origin) for s, origin in zip(prepared, scored.origins) if origin[0] in places]
        if all(s.old_logprobs is not None for s, _ in chosen):  # recomputed for the update: not scored twice
            trainer = [s.old_logprobs for s, _ in chosen]
        else:
            trainer = trainers.score([s for s, _ in chosen], cfg.trainer, temperature=cfg.rollout.temperature,
                                     top_p=cfg.rollout.top_p)
        lines = []
        for (seq, (place, index)), trainer_logprobs in zip(chosen, trainer):
            group = scored.groups[place]
            answer = group.group.completions[index]
            lines.append(json.dumps({
                "step": step, "group": place, "answer": index,
                "prompt": group.group.sample.prompt, "prompt_ids": seq.prompt_ids,
                "response": group.responses[index], "response_ids": seq.response_ids,
                "reward": group.rewards[index], "advantage": seq.advantage, "finish_reason": answer.finish_reason,
                "versions": answer.versions, "engine_logprobs": seq.logprobs, "trainer_logprobs": trainer_logprobs,
                **({"mask": seq.mask} if seq.mask is not None else {}),
                **({"token_advantages": seq.token_advantages, "returns": seq.returns, "values": seq.old_values}
                   if seq.returns is not None else {})}))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write("".join(f"{line}\n" for line in lines))
            if f.tell() >= self._limit:
                f.write(json.dumps({"event": "rollouts_stopped", "step": step,
                                    "why": f"logging.rollouts_max_mb={self.cfg.rollouts_max_mb} reached"}) + "\n")
                self.full = True
