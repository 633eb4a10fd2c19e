"""The console sink (collage_train/metrics/sinks.py): the summary table when the run ends,
and the end-of-run sample as the run's last words, printed when the sink closes (the
trainer closes the console after the other sinks, whose closing may print: W&B does)."""

from __future__ import annotations

from collage_train.metrics.sinks import ConsoleSink


def test_the_sample_is_printed_at_close_after_the_summary_table(capsys):
    sink = ConsoleSink("plain", max_steps=2, start_step=0)
    sink.summary({"model": "gpt_tiny", "sample": "def f(x):\n    return [x]"})
    table = capsys.readouterr().out
    assert "run summary" in table and "gpt_tiny" in table
    assert "return" not in table and "sample" not in table
    print("W&B's closing lines")  # another sink, closed before the console
    sink.close()
    out = capsys.readouterr().out
    assert out.index("W&B's closing lines") < out.index("what the model writes now")
    assert out.index("what the model writes now") < out.index("def f(x):\n    return [x]")
    sink.close()  # once
    assert capsys.readouterr().out == ""


def test_a_run_without_a_sample_ends_with_its_table(capsys):
    sink = ConsoleSink("plain", max_steps=2, start_step=0)
    sink.summary({"model": "gpt_tiny"})
    sink.close()
    out = capsys.readouterr().out
    assert "run summary" in out and "what the model writes now" not in out
