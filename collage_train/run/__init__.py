"""A run's components and housekeeping, around the training loop (``collage_train.trainer``).

The loop's components: ``model_setup``, ``stepper``, ``guarded_window`` (with ``guard``
and ``step_window``), ``checkpointer`` (with ``checkpoint_saver``), ``stop_signal``,
``watchdog``, ``resume``, ``run_log`` and ``report``, ``finish``. Before a run starts:
``directory`` (the run directory's lock, the Hydra callback) and ``validate`` (with
``vocabulary``). Around runs: ``sweep`` (with ``sweep_stop``) and ``determinism``.
What each does, one line each: docs/design.md, "The run package's modules".
docs/runs.md describes what a run directory holds and how a run resumes.
"""
