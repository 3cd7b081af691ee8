"""The consistency bench's comparison (bench/consistency.py compare): bit-equality per token, at the first answer
token and after it, and where each sequence first differs."""

from __future__ import annotations

import pytest

from colocate.bench.consistency import compare


def test_compare_counts_bit_equal_tokens_and_the_first_difference():
    a = [[-1.0, -2.0, -3.0], [-0.5, -0.25]]
    b = [[-1.0, -2.0, -3.5], [-0.5 + 2 ** -30, -0.25]]
    c = compare(a, b)
    assert c["tokens"] == 5 and c["bit_equal"] == pytest.approx(3 / 5)
    assert c["bit_equal_first_token"] == 0.5  # the second sequence differs at its first token, by 2^-30: not equal
    assert c["bit_equal_after"] == pytest.approx(2 / 3)
    assert c["first_difference_position_median"] == 1  # positions 2 and 0
    assert c["max_abs"] == 0.5 and c["mean_abs"] == pytest.approx((0.5 + 2 ** -30) / 5)


def test_compare_of_equal_logprobs_is_all_equal_and_a_length_mismatch_is_a_bug():
    a = [[-1.0], [-2.0, -3.0]]
    c = compare(a, a)
    assert c["bit_equal"] == c["bit_equal_first_token"] == c["bit_equal_after"] == 1.0 and c["max_abs"] == 0.0
    assert c["first_difference_position_median"] == 1.5  # no difference: each sequence's length
    with pytest.raises(AssertionError):
        compare([[-1.0, -2.0]], [[-1.0]])


def test_the_engine_arguments_of_the_consistent_paths_merge_into_the_users():
    from colocate.engine.actor import head_dtype_override, without_rotary_kernel

    assert without_rotary_kernel(None) == {"custom_ops": ["-rotary_embedding"]}
    assert without_rotary_kernel({"custom_ops": ["+rms_norm"], "level": 0}) == {
        "custom_ops": ["+rms_norm", "-rotary_embedding"], "level": 0}
    assert head_dtype_override({"rope_theta": 1e6}) == {"rope_theta": 1e6, "head_dtype": "float32"}
