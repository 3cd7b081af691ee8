"""Checkpoints of a job, and resuming from them.

    checkpoint.dir/
      step_00000009/              one complete checkpoint: the state after step 9 (10 steps done)
        trainer/                  DCP: each rank's FSDP2 shards of the model and AdamW state, rank 0's .metadata
        rng_rank<r>.json          each trainer rank's RNG states
        controller.json           step, the prompt source's place, the rollout pool's unfinished answers
        model/                    config.json, generation config and tokenizer files of the model trained
        hf/                       (checkpoint.export_hf) the model as safetensors, loadable by vLLM/transformers
        meta.json                 written last: model and job facts a resume is checked against
      step_00000014.partial/      a save in progress (or killed): never resumed from, replaced by the next save

A save writes into `step_<N>.partial/` and renames it to `step_<N>/` once meta.json is in: the rename is the
commit, so a checkpoint that exists is whole, whatever happened during the save. Then all but the newest
`checkpoint.keep_last` are deleted. What the controller writes is JSON (no pickle is read back on resume);
the trainer shards are DCP's format.

Resume (`checkpoint.resume=auto|PATH`, or `resume=...` on the command line) is checked before any actor starts
(`resume_point`): the checkpoint must be complete and come from the same model architecture, the same number of
trainer ranks and the same group size; the reason is given in one line otherwise. The engines need nothing:
their weights come from the trainers' first sync after the load (Controller.restore).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from colocate.config import JobConfig
from colocate.errors import ConfigError

log = logging.getLogger("colocate")

COMMIT_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# model files a checkpoint carries, so that export and resume need not find the original model again
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
               "chat_template.jinja")
# config.json entries that do not change the weights' names or shapes
_MODEL_KEYS_IGNORED = {"torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures_version",
                       "use_cache"}
# named first when two models differ: what a user recognises a model by
_SHAPE_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
               "num_attention_heads", "num_key_value_heads")


def checkpoint_root(cfg: JobConfig) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.logging.output_dir) / "checkpoints").expanduser()


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / COMMIT_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def model_signature(model_path: str | Path) -> dict:
    """What fixes the weights' names and shapes: the model's config.json less its bookkeeping entries."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return {k: v for k, v in sorted(config.items()) if k not in _MODEL_KEYS_IGNORED}


def job_signature(cfg: JobConfig, model_path: str | Path) -> dict:
    """The facts a checkpoint must share with the job resuming from it."""
    return {"model": model_signature(model_path), "num_trainer_ranks": cfg.placement.num_trainer_ranks,
            "num_samples": cfg.rollout.num_samples, "multi_turn": bool(cfg.rollout.env), "lora": _lora(cfg),
            "critic": _critic(cfg)}


_NO_CRITIC = "no critic (critic.model_path empty)"


def _critic(cfg: JobConfig) -> str:
    """Whether the checkpoint holds a value model's state, and which model it started from."""
    return f"a critic (critic.model_path={cfg.critic.model_path})" if cfg.critic.enabled else _NO_CRITIC


_NO_LORA = "no LoRA (trainer.lora.rank=0)"


def _lora(cfg: JobConfig) -> str:
    """What fixes a LoRA job's trained tensors and what they compute: rank, alpha and targets."""
    lora = cfg.trainer.lora
    return (f"LoRA (trainer.lora.rank={lora.rank}, alpha={lora.alpha:g}, target_modules={lora.target_modules})"
            if lora.rank else _NO_LORA)


def resume_point(cfg: JobConfig, model_path: str | Path) -> Path | None:
    """The checkpoint to resume from (None: start afresh), checked against this job. Raises ConfigError."""
    spec = cfg.checkpoint.resume
    if not spec:
        return None
    if spec == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        if not found:
            log.warning("checkpoint.resume=auto: no complete checkpoint in %s; starting afresh", checkpoint_root(cfg))
            return None
        path = found[-1][1]
    else:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ConfigError(f"checkpoint.resume={spec!r} is invalid: no such directory; valid: auto, or a "
                              "step_<N> folder of a checkpoint directory")
        if not (path / COMMIT_FILE).is_file():
            raise ConfigError(f"checkpoint.resume={spec!r} is invalid: not a complete checkpoint (no {COMMIT_FILE}: "
                              "its save did not finish); valid: auto, or a step_<N> folder holding meta.json")
    check_compatible(path, job_signature(cfg, model_path))
    return path


def check_compatible(path: Path, mine: dict) -> None:
    theirs = json.loads((path / COMMIT_FILE).read_text())["signature"]
    if theirs["model"] != mine["model"]:
        keys = sorted(set(theirs["model"]) | set(mine["model"]), key=lambda k: (k not in _SHAPE_KEYS, k))
        diff = [k for k in keys if theirs["model"].get(k) != mine["model"].get(k)]
        shown = ", ".join(f"{k}={theirs['model'].get(k)!r} there, {mine['model'].get(k)!r} here" for k in diff[:3])
        raise ConfigError(f"checkpoint.resume={str(path)!r} is invalid: it was saved from another model ({shown})")
    for key, what in (("num_trainer_ranks", "trainer ranks (placement.num_slots - placement.engine_slots)"),
                      ("num_samples", "samples per prompt (rollout.num_samples)")):
        if theirs[key] != mine[key]:
            raise ConfigError(f"checkpoint.resume={str(path)!r} is invalid: it was saved with {theirs[key]} {what}, "
                              f"this job has {mine[key]}")
    # answers in flight carry observation masks, or none: one kind cannot go on as the other (a checkpoint of an
    # earlier release has no such key: single-turn)
    if theirs.get("multi_turn", False) != mine["multi_turn"]:
        kinds = {True: "multi-turn episodes (rollout.env set)", False: "single-turn answers (rollout.env empty)"}
        raise ConfigError(f"checkpoint.resume={str(path)!r} is invalid: it was saved with "
                          f"{kinds[theirs.get('multi_turn', False)]}, this job has {kinds[mine['multi_turn']]}")
    theirs_critic = theirs.get("critic", _NO_CRITIC)  # an earlier release's: no critic
    if theirs_critic != mine["critic"]:
        raise ConfigError(f"checkpoint.resume={str(path)!r} is invalid: it was saved with {theirs_critic}, this job "
                          f"has {mine['critic']}")
    theirs_lora = theirs.get("lora", _NO_LORA)  # a checkpoint of an earlier release: it trained every weight
    if theirs_lora != mine["lora"]:
        raise ConfigError(f"checkpoint.resume={str(path)!r} is invalid: it was saved with {theirs_lora}, this job "
                          f"has {mine['lora']}")
