"""W&B's own step for each record (collage_train/metrics/wandb_steps.py): the training step
while it goes forward, never a step already used when it goes back, and a continued run
above every step an earlier process took."""

from __future__ import annotations

from collage_train.metrics.wandb_steps import STEP_FILE, WandbSteps


def test_training_steps_forward_are_wandb_steps_and_one_step_shares_a_row(tmp_path):
    steps = WandbSteps(tmp_path, continued=False)
    placed = [steps.place(step) for step in (1, 2, 2, 3, 5, 5)]  # train + val at 2 and 5
    assert placed == [1, 2, 2, 3, 5, 5]
    assert (tmp_path / STEP_FILE).read_text() == "5\n"


def test_a_step_back_takes_the_next_wandb_step_and_the_steps_after_it_follow(tmp_path):
    """Skips at 6 and 7, the rollback's record at the checkpoint's step 4, then 5-8 again;
    a second rollback to 6 later."""
    steps = WandbSteps(tmp_path, continued=False)
    placed = [steps.place(step) for step in (5, 6, 7, 4, 4, 5, 6, 7, 8, 6, 7)]
    assert placed == [5, 6, 7, 8, 8, 9, 10, 11, 12, 13, 14]
    assert (tmp_path / STEP_FILE).read_text() == "14\n"


def test_a_continued_run_starts_above_the_highest_step_any_process_took(tmp_path):
    first = WandbSteps(tmp_path, continued=False)
    for step in (1, 2, 3, 4, 5, 6, 4, 5):  # a rollback from 6 to 4; killed after step 5
        first.place(step)
    resumed = WandbSteps(tmp_path, continued=True)  # from the checkpoint of step 4
    assert [resumed.place(step) for step in (5, 6, 7)] == [9, 10, 11]
    # W&B's own next step (online, a resumed run's) wins where it is higher
    assert WandbSteps(tmp_path, continued=True, first=40).place(12) == 40
    assert WandbSteps(tmp_path, continued=False).place(1) == 1  # a new W&B run: afresh


def test_a_run_stopped_at_its_checkpoint_goes_on_at_wandb_step_equal_training_step(tmp_path):
    first = WandbSteps(tmp_path, continued=False)
    for step in (1, 2, 3):  # train.stop_at_step=3, its checkpoint at 3
        first.place(step)
    resumed = WandbSteps(tmp_path, continued=True)
    assert [resumed.place(step) for step in (4, 5)] == [4, 5]


def test_a_missing_or_torn_step_file_counts_from_wandbs_own_first_step(tmp_path):
    assert WandbSteps(tmp_path, continued=True).place(3) == 3  # no file yet
    (tmp_path / STEP_FILE).write_text("")  # not a number: as if missing
    assert WandbSteps(tmp_path, continued=True, first=8).place(3) == 8
