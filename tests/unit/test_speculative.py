"""rollout.speculative (ngram prompt lookup): the refusals before any actor starts (on a CPU run always: vLLM
0.32's CPU build samples tokens off the policy's distribution with drafts, scripts/probe_cpu_speculative.py), vLLM's
speculative_config as a CUDA engine gets it, and the acceptance the step's record reports."""

from __future__ import annotations

import pytest

from colocate.config import load_config
from colocate.engine.actor import speculative_config
from colocate.errors import ConfigError
from colocate.job.placement import plan_slots
from colocate.rollout.passes import _speculation_stats


def test_the_engine_gets_ngram_prompt_lookup_with_the_drafts_asked_for():
    cfg = load_config(None, ["rollout.speculative=ngram", "rollout.speculative_tokens=3"])
    assert speculative_config(cfg.rollout) == {"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert speculative_config(load_config(None, []).rollout) is None


def test_acceptance_is_the_drafts_accepted_per_step_over_those_proposed():
    cfg = load_config(None, ["rollout.speculative=ngram", "rollout.speculative_tokens=4"])
    # 10 request-steps gave 22 tokens: 1.2 drafts accepted a step of 4 proposed
    assert _speculation_stats(cfg.rollout, [10, 22]) == pytest.approx(
        {"tokens_per_request_step": 2.2, "speculative_acceptance": 0.3})
    assert _speculation_stats(load_config(None, []).rollout, [10, 10]) == {"tokens_per_request_step": 1.0}


@pytest.mark.parametrize("overrides, needles", [
    (["rollout.speculative=eagle"], ["rollout.speculative='eagle' is invalid", "ngram"]),
    (["rollout.speculative=ngram", "rollout.temperature=0.7"], ["rollout.temperature=0.7 is invalid", "1.0"]),
    (["rollout.speculative=ngram", "rollout.top_p=0.9"], ["rollout.top_p=0.9 is invalid", "1.0"]),
    (["rollout.speculative=ngram", "rollout.speculative_tokens=0"], ["rollout.speculative_tokens=0 is invalid"]),
], ids=["no_such_method", "temperature", "top_p", "no_drafts"])
def test_bad_speculative_settings_are_one_line(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_a_cpu_run_refuses_speculation_in_one_line_naming_the_probe():
    cfg = load_config(None, ["rollout.speculative=ngram"])
    with pytest.raises(ConfigError) as info:
        plan_slots(cfg, device="cpu", num_devices=2)
    message = str(info.value)
    assert "\n" not in message and message.startswith("rollout.speculative='ngram' is invalid on a CPU run")
    assert "scripts/probe_cpu_speculative.py" in message and info.value.fix == {"rollout.speculative": ""}
