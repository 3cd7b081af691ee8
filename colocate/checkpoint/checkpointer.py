"""Saving the job's checkpoints and loading one: the trainers' shards (a collective), the controller's JSON, the
model's files; a save is committed by renaming step_N.partial to step_N (layout.py says what the folder holds).

    checkpointer = Checkpointer(cfg, model_path)
    if checkpointer.due(num_done, num_steps): checkpointer.save(step, trainers, controller_state)
    controller_state = Checkpointer.load(path, trainers)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from colocate.checkpoint.export import export_hf
from colocate.checkpoint.layout import (
    COMMIT_FILE,
    MODEL_FILES,
    checkpoint_root,
    complete_checkpoints,
    job_signature,
    step_path,
)
from colocate.config import JobConfig, to_dict


class Checkpointer:
    """Saves the job's state after chosen steps and keeps the newest few."""

    def __init__(self, cfg: JobConfig, model_path: str):
        self.cfg, self.model_path = cfg, model_path
        self.root = checkpoint_root(cfg)

    def due(self, num_done: int, num_steps: int) -> bool:
        every, at_end = self.cfg.checkpoint.every_steps, self.cfg.checkpoint.at_end
        return (at_end and num_done == num_steps) or (every > 0 and num_done % every == 0)

    def save(self, step: int, trainers: list, controller_state: dict) -> Path:
        """A collective of the trainers (each writes its shards) and the controller's JSON; committed by the
        rename of the finished folder. Returns the checkpoint's path."""
        import ray

        final = step_path(self.root, step)
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # a save killed halfway
        partial.mkdir(parents=True)
        started = time.perf_counter()
        ray.get([t.save_checkpoint.remote(str(partial)) for t in trainers])
        (partial / "controller.json").write_text(json.dumps(controller_state))
        (partial / "model").mkdir()
        for name in MODEL_FILES:
            if (Path(self.model_path) / name).is_file():
                shutil.copy2(Path(self.model_path) / name, partial / "model" / name)
        if self.cfg.checkpoint.export_hf:
            export_hf(partial, partial / "hf", dtype=self.cfg.engine.dtype, lora_alpha=self.cfg.trainer.lora.alpha)
        meta = {"step": step, "time": time.time(), "signature": job_signature(self.cfg, self.model_path),
                "config": to_dict(self.cfg), "seconds": time.perf_counter() - started}
        (partial / COMMIT_FILE).write_text(json.dumps(meta, indent=1))
        if final.exists():  # the same step saved again by a run resumed from before it
            shutil.rmtree(final)
        os.rename(partial, final)
        self.prune()
        return final

    def prune(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        if keep:
            for _, path in complete_checkpoints(self.root)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def load(path: Path, trainers: list) -> dict:
        """Load the trainer shards (a collective) and return the controller's state."""
        import ray

        ray.get([t.load_checkpoint.remote(str(path)) for t in trainers])
        return json.loads((path / "controller.json").read_text())
