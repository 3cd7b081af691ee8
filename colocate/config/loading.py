"""The edge: a YAML file and `key=value` overrides, merged by OmegaConf onto the defaults and converted once into
a checked JobConfig (types, unknown keys, each field's own checks); and back to plain dicts.

    cfg = load_config("configs/default.yaml", ["engine.tp=1", "resume=auto"])
    to_dict(cfg)   # plain nested dicts, as config.yaml and checkpoints record it
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from colocate.config.fields import bad, override_value
from colocate.config.schema import JobConfig
from colocate.errors import ConfigError


def load_config(paths: str | list[str] | tuple[str, ...] | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Merge the YAML files (if any, in order: a later file's keys win, e.g. a job config then an algorithm
    preset) and `key=value` overrides onto the defaults; checked as `JobConfig.check`."""
    from omegaconf import OmegaConf

    merged = OmegaConf.create({})
    for path in [paths] if isinstance(paths, str) else list(paths or []):
        merged = OmegaConf.merge(merged, _load_yaml(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is invalid: expected key=value, e.g. engine.tp=2")
        key, _, raw = item.partition("=")
        key = _ALIASES.get(key, key)
        try:  # the value is read as YAML (numbers, booleans, mappings)
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={raw}"]))
        except Exception as e:  # yaml's and OmegaConf's parse errors: one line naming the override
            raise ConfigError(f"override {item!r} is invalid: its value is not valid YAML "
                              f"({_first_line(e)}); quote it, e.g. {key}='...'") from None
    cfg = from_dict(OmegaConf.to_container(merged, resolve=True) or {})
    cfg.check()
    return cfg


def _load_yaml(path: str):
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and OmegaConf's own errors
        raise ConfigError(f"config file {path!r} is not valid YAML: {_first_line(e)}") from None
    if not isinstance(loaded, typing.Mapping):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections (model:, engine:, ...)")
    return loaded


def from_dict(data: dict) -> JobConfig:
    """Build a JobConfig from plain nested dicts, rejecting unknown keys and values of the wrong type."""
    return _build(JobConfig, data, prefix="")


def _build(cls, data, *, prefix: str):
    if not isinstance(data, dict):
        raise bad(prefix.rstrip(".") or "config", data, "expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key in RENAMED:
            raise ConfigError(f"{key}={value!r} is no longer a key: it is {RENAMED[key]} now; use "
                              f"{RENAMED[key]}={override_value(value)}", fix={RENAMED[key]: value})
        if key in _REPLACED:
            raise ConfigError(f"{key!r} is no longer a key: {_REPLACED[key]}")
        if name not in fields:
            raise ConfigError(f"unknown key {key!r}; valid keys here: {', '.join(fields)}")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


# keys of earlier releases under their new names (the value carries over: ConfigError.fix names it)
RENAMED = {"sync.transport": "sync.method"}  # "transport" also named the buffers' module (now sync/buffers.py)
# keys of earlier releases, and what took their place
_REPLACED = {"algo.normalize_advantages": "algo.advantage=grpo divides by the group's std (true), "
             "algo.advantage=dr_grpo does not (false)"}
# short forms accepted on the command line: `colocate launch ... resume=auto`
_ALIASES = {"resume": "checkpoint.resume"}
# str keys that hold JSON: a YAML mapping given for them (engine.extra_args: {block_size: 32}) is kept as JSON text
_JSON_KEYS = {"engine.extra_args", "data.chat_template_kwargs", "rollout.source_rewards"}
# str keys that hold a comma-separated list: a YAML list given for them is joined with commas
_LIST_KEYS = {"data.train_files", "data.val_files", "trainer.lora.target_modules"}


def _coerce(key: str, value, hint):
    args = typing.get_args(hint)
    if type(None) in args:  # `int | None`: null (YAML, or key=null) is None
        (inner,) = [a for a in args if a is not type(None)]
        return None if value is None else _coerce(key, value, inner)
    if set(args) == {int, str}:  # `int | str`: an integer, or auto decided later (placement.engine_slots)
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise bad(key, value, "expected an integer, or auto")
    if key in _JSON_KEYS and isinstance(value, (dict, list)):
        import json

        return json.dumps(value)
    if key in _LIST_KEYS and isinstance(value, list):
        if not all(isinstance(v, str) and "," not in v for v in value):
            raise bad(key, value, "expected a list of names or file paths, each without commas")
        return ",".join(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad(key, value, "expected true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad(key, value, "expected an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad(key, value, "expected a number")
    if hint is str:
        if value is None:
            return ""
        if isinstance(value, bool):  # keys that take true/false/auto (YAML reads true as a bool)
            return str(value).lower()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad(key, value, "expected a string")
    raise AssertionError(f"unsupported config type {hint} for {key}")


def to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
