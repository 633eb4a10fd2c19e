"""A run's components and housekeeping, around the training loop (``collage_train.trainer``).

- ``model_setup``: the run's model, built to fit, handed to the engine;
- ``stepper``: a step's forward and backward, its lr and EDQ tracking;
- ``guarded_window``: the step counters, the step guard's verdicts acted on at a settle;
- ``checkpointer``: when the run checkpoints, its saves and restores;
- ``directory``: the run directory's lock and the Hydra callback that validates a run
  before anything is written into its directory;
- ``validate``: the start-up checks of a configuration, one ``error:`` line each
  (``vocabulary``: the model's embedding against its tokenizer);
- ``resume``: the identity of a run and the checks before a checkpoint is resumed;
- ``checkpointing``: saving a checkpoint (in the background) and restoring one across
  ranks and layouts;
- ``stop_signal``: a stop signal acted on at the same step on every rank;
- ``finish``: what a finished run writes after its last step (export, sample, summary),
  each failure a warning, never the run's;
- ``guard``: the step guard: an optimizer step whose loss or gradient norm is
  non-finite or an outlier is refused;
- ``step_window``: a window of steps' device statistics (the guard's verdicts among
  them) turned into host numbers with one wait;
- ``run_log``: where a run's records and console lines go while it trains;
- ``watchdog``: the hang watchdog: a rank whose steps stopped records its stacks and exits;
- ``sweep``: Hydra sweeps, each job in its own directory (``sweep_stop``: a stop
  signal ends the sweep after the current job's checkpoint);
- ``determinism``: ``train.deterministic``: the same bits on a GPU too;
- ``report``: what a run says about itself: its start-up line, a record per logged
  window, ``summary.json`` and ``plots/`` at the end.

docs/runs.md describes what a run directory holds and how a run resumes.
"""
