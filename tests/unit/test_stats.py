import dataclasses

import numpy as np

from colocate.trainer.stats import ONE_PER_STEP, TrainStats


def test_ranks_add_field_by_field_and_arrays_concatenate():
    a = TrainStats(tokens=3, loss_sum=1.5, kl_sum=0.25, token_log_w=np.array([0.1, 0.2, 0.3], np.float32),
                   seq_log_w=np.array([0.6], np.float32), grad_norm=2.0)
    b = TrainStats(tokens=1, loss_sum=0.5, clipped_sum=1, token_log_w=np.array([0.4], np.float32),
                   seq_log_w=np.array([0.4], np.float32), grad_norm=2.0)
    total = sum([a, b], TrainStats())
    assert (total.tokens, total.loss_sum, total.kl_sum, total.clipped_sum) == (4, 2.0, 0.25, 1)
    np.testing.assert_allclose(total.token_log_w, [0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(total.seq_log_w, [0.6, 0.4])
    assert total.grad_norm == 2.0 and total.per_token("loss_sum") == 0.5
    assert TrainStats().per_token("loss_sum") == 0.0  # no tokens: no division by zero


def test_every_field_takes_part_in_the_sum():
    # a new statistic is a field and nothing else: the sum may not drop it
    ones = TrainStats(**{f.name: 1.0 for f in dataclasses.fields(TrainStats)
                         if f.name not in ("token_log_w", "seq_log_w")})
    total = ones + ones
    assert all(getattr(total, f.name) == 2.0 for f in dataclasses.fields(TrainStats)
               if f.name not in ("token_log_w", "seq_log_w", *ONE_PER_STEP))
