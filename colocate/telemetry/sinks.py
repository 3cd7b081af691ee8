"""Optional metric sinks beside metrics.jsonl: TensorBoard event files and Weights & Biases.

    check_sinks(cfg.logging)                               # ConfigError before any actor starts
    sinks = open_sinks(cfg.logging, run_config=to_dict(cfg))
    for sink in sinks:
        sink.log(scalar_tags(record), step=record["step"] + 1)

metrics.jsonl stays the source of truth (every key, events, samples); a sink gets each step's numbers flattened to
tags ("times/rollout", "eval/pass_at_1") at global step `step + 1`, the number of finished steps, so the first step
is 1 as on the progress line. Strings, lists and flags are left to the JSONL.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from colocate.config import LoggingConfig
from colocate.errors import ConfigError

log = logging.getLogger("colocate")

# Keys that are the step's coordinates, not metrics of it.
_NOT_METRICS = {"step", "time"}


def scalar_tags(record: dict, prefix: str = "") -> dict[str, float]:
    """{"times": {"rollout": 1.2}, "kl": 0.01, "sample": {...}} -> {"times/rollout": 1.2, "kl": 0.01}: numbers only,
    nested dicts joined with "/" (TensorBoard and W&B group a tag by what comes before its first "/")."""
    tags: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in _NOT_METRICS:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            tags.update(scalar_tags(value, prefix=f"{tag}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):  # a bool is a flag, not a curve
            tags[tag] = float(value)
    return tags


class Sink(Protocol):
    def log(self, tags: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


def check_sinks(cfg: LoggingConfig) -> None:
    """The sinks' packages and credentials, checked where the job's driver runs and before any actor starts, so a
    missing package is one line and exit code 2 rather than an error after minutes of model loading."""
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
                          "(or set logging.tensorboard=false)")
    if not cfg.wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package: pip install 'colocate[wandb]'")
    if cfg.wandb_mode == "online" and not _has_wandb_key():
        raise ConfigError("logging.wandb_mode=online needs WANDB_API_KEY (or `wandb login`); "
                          "logging.wandb_mode=offline works without network")


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    # `wandb login` stores the key in ~/.netrc under the API host
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def open_sinks(cfg: LoggingConfig, run_config: dict | None = None) -> list[Sink]:
    check_sinks(cfg)
    sinks: list[Sink] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(Path(cfg.output_dir) / "tensorboard"))
    if cfg.wandb:
        name = cfg.wandb_run_name or Path(cfg.output_dir).expanduser().resolve().name
        sinks.append(WandbSink(Path(cfg.output_dir), project=cfg.wandb_project, mode=cfg.wandb_mode, name=name,
                               run_config=run_config or {}))
    return sinks


class TensorBoardSink:
    """Event files under `log_dir` (`tensorboard --logdir <output_dir>/tensorboard`); a rerun into the same
    directory adds a new events file that TensorBoard shows beside the old one."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # local: pulls in tensorboard, only when enabled

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, tags: dict[str, float], step: int) -> None:
        for tag, value in tags.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()  # a killed run keeps every finished step, as the JSONL does

    def close(self, failed: bool) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per job. Offline mode writes under `<root>/wandb/offline-run-*` with no network (`wandb sync`
    uploads it later); online streams to the W&B server."""

    def __init__(self, root: Path, *, project: str, mode: str, name: str, run_config: dict):
        import wandb  # local: an optional dependency, imported only when logging.wandb=true

        root.mkdir(parents=True, exist_ok=True)
        # console="off": the progress bar's carriage returns and the actors' log lines would be copied into the
        # run (metrics.jsonl and the job's log keep them); quiet: no history table printed at the end of the job
        settings = wandb.Settings(console="off", quiet=True)
        self._run = wandb.init(project=project, name=name, mode=mode, dir=str(root), config=run_config,
                               settings=settings)

    def log(self, tags: dict[str, float], step: int) -> None:
        self._run.log(tags, step=step)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
