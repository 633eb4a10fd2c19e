"""Measuring the model while it trains: validation loss on held-out windows
(``validation``) and downstream tasks through lm-evaluation-harness.

``downstream``: the tasks through lm-evaluation-harness, in the loop
(``eval.tasks``) and from a checkpoint (``python -m collage_train.evaluate``);
``generators``: the process's random generators put back as they were
around the harness.
"""
