"""Where a launch's records and lines go: every record to every sink, lines on rank 0."""

from __future__ import annotations

from collage_train.metrics import RecordingSink
from collage_train.run.run_log import RunLog


def test_records_reach_every_sink_and_lines_print_on_rank_zero_only(capsys):
    sinks = [RecordingSink(), RecordingSink()]
    main, other = (
        RunLog(sinks, is_main=True, tokens_per_step=8),
        RunLog([], is_main=False, tokens_per_step=8),
    )
    main.at_step(3, {"downstream/t/acc": 0.5})
    main.at_step(3, {})  # nothing to log
    main.validation(4, {"val_loss": 2.0})
    main.skips([{"step": 5, "skip_reason": "loss spike", "line": "step 5 skipped (loss spike)"}])
    other.notice("not printed")
    for sink in sinks:
        assert sink.records == [
            {"step": 3, "tokens": 24, "downstream/t/acc": 0.5},
            {"step": 4, "tokens": 32, "val_loss": 2.0},
            {"step": 5, "skip_reason": "loss spike"},
        ]
    assert main.last_validation == {"val_loss": 2.0}
    assert capsys.readouterr().out == "warning: step 5 skipped (loss spike)\n"
