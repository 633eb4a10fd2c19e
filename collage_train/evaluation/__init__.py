"""Measuring the model while it trains: validation loss on held-out windows
(``validation``) and downstream tasks through lm-evaluation-harness."""
