"""Will a run fit: the one rule that splits a global batch into micro-batches
(``batch``), the memory planner's predicted peak per precision strategy and setting
(``memory_plan``, behind ``python -m collage_train.plan``; docs/planner.md), and the
start-up checks that refuse a run that will not fit its device (``fit_check``).
"""
