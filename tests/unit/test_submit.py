"""`colocate submit` runs exactly the validated config: every resolved key becomes an override."""

from __future__ import annotations

import shlex

import pytest

from colocate.cluster.submit import entrypoint
from colocate.config import load_config


def test_entrypoint_round_trips_the_resolved_config():
    cfg = load_config(None, ["engine.tp=1", "placement.num_slots=1", "logging.output_dir=out dir/x",
                             "rollout.reward_fn=tests.e2e.rewards:explode_in_second_step",
                             "placement.ray_address=auto"])
    argv = shlex.split(entrypoint(cfg))
    assert argv[:6] == ["python", "-m", "colocate.cli", "launch", "--address", "auto"]
    assert "logging.output_dir=out dir/x" in argv
    assert not any(a.startswith("placement.ray_address") for a in argv)
    resolved = load_config(None, argv[6:] + ["placement.ray_address=auto"])
    assert resolved == cfg


@pytest.mark.parametrize("value", ["[0-9]+", "Rate this. Question: {prompt} Answer: {response}", "true", "12",
                                   'say "{answer}"\nscore: ', "- {prompt}", "{prompt}: {response}"])
def test_string_values_that_yaml_would_misread_round_trip(value):
    """A string the override's YAML would read as something else, or not read at all, goes quoted."""
    cfg = load_config(None, [])
    cfg.reward_model.judge_prompt = value
    argv = shlex.split(entrypoint(cfg))
    assert load_config(None, argv[6:]).reward_model.judge_prompt == value
