"""The one rule for splitting a global batch, shared by the trainer and the planner."""

import pytest

from collage_train.errors import ConfigError
from collage_train.planning.batch import accumulation_steps, micro_batch_choices


def test_accumulation_steps_split_the_global_batch_exactly():
    assert accumulation_steps(16, 4, 1) == 4
    assert accumulation_steps(16, 4, 2) == 2
    assert accumulation_steps(16, 16, 1) == 1
    with pytest.raises(ConfigError, match=r"not divisible .* multiple of 3"):
        accumulation_steps(16, 3, 1)
    with pytest.raises(ConfigError, match="micro_batch_size must be at least 1 sequence, got 0"):
        accumulation_steps(16, 0, 1)


def test_the_choices_are_exactly_the_micro_batches_the_trainer_accepts():
    for global_batch, world in ((512, 8), (12, 2), (7, 1), (96, 3)):
        choices = micro_batch_choices(global_batch, world)
        accepted = []
        for micro in range(1, global_batch + 1):
            try:
                accumulation_steps(global_batch, micro, world)
            except ConfigError:
                continue
            accepted.append(micro)
        assert choices == accepted, (global_batch, world)
    assert micro_batch_choices(512, 8)[-1] == 64 and micro_batch_choices(7, 1) == [1, 7]
    with pytest.raises(ConfigError, match="not divisible by the world size 8"):
        micro_batch_choices(12, 8)
