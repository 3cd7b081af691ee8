"""The user's plug-ins by "module.sub:attr" (a task, a reward, an environment): imported once, and a path that
cannot be imported or called is one line naming the config key, never an ImportError from deep inside.

    factory = import_object("my_tasks:make_task", "rollout.task", "valid: copy, reverse, add, or module:factory")
"""

from __future__ import annotations

import importlib
from typing import Any

from colocate.errors import ConfigError


def import_object(spec: str, key: str, valid: str) -> Any:
    """Import "module.sub:attr" and return the attribute; ConfigError naming `key` if that fails."""
    module_name, colon, attr_name = spec.partition(":")
    if not colon or not module_name or not attr_name:
        raise ConfigError(f"{key}={spec!r} is invalid: {valid}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}={spec!r} is invalid: cannot import {module_name!r} ({exc}); {valid}") from exc
    try:
        obj = getattr(module, attr_name)
    except AttributeError as exc:
        raise ConfigError(f"{key}={spec!r} is invalid: {module_name!r} has no {attr_name!r}; {valid}") from exc
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r} is invalid: {attr_name!r} is not callable; {valid}")
    return obj
