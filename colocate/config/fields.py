"""The checks config sections make of their own fields, and the one-line error they raise: `key=value is invalid:
<what is valid>`."""

from __future__ import annotations

from colocate.errors import ConfigError


def bad(key: str, value, valid: str, *, fix: dict[str, object] | None = None) -> ConfigError:
    """`fix`: the overrides the hint in `valid` suggests (ConfigError.fix); its text should name them."""
    return ConfigError(f"{key}={value!r} is invalid: {valid}", fix=fix)


def overrides(fix: dict[str, object]) -> str:
    """`fix` as the command line writes it: `rollout.partial_tokens=2 rollout.max_lag=1` (true, false, null)."""
    return " ".join(f"{key}={override_value(value)}" for key, value in fix.items())


def override_value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


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
