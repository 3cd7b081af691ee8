"""The checks config sections make of their own fields, and the one-line error they raise: `key=value is invalid:
<what is valid>`."""

from __future__ import annotations

from colocate.errors import ConfigError


def bad(key: str, value, valid: str) -> ConfigError:
    return ConfigError(f"{key}={value!r} is invalid: {valid}")


def positive(section, prefix: str, *names: str) -> None:
    for name in names:
        if not getattr(section, name) > 0:
            raise bad(f"{prefix}.{name}", getattr(section, name), "must be > 0")


def non_negative(section, prefix: str, *names: str) -> None:
    for name in names:
        if getattr(section, name) < 0:
            raise bad(f"{prefix}.{name}", getattr(section, name), "must be >= 0")


def one_of(section, prefix: str, name: str, valid: list) -> None:
    if getattr(section, name) not in valid:
        raise bad(f"{prefix}.{name}", getattr(section, name), "valid: " + ", ".join(map(str, valid)))
