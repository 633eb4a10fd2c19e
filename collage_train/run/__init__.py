"""A run's housekeeping, around the training loop (``collage_train.trainer``).

- ``directory``: the run directory's lock and the Hydra callback that validates a run
  before anything is written into its directory;
- ``validate``: the start-up checks of a configuration, one ``error:`` line each
  (``vocabulary``: the model's embedding against its tokenizer);
- ``resume``: the identity of a run and the checks before a checkpoint is resumed;
- ``checkpointing``: saving a checkpoint (in the background) and restoring one across
  ranks and layouts;
- ``stop_signal``: a stop signal acted on at the same step on every rank;
- ``finish``: what a finished run writes after its last step (export, sample, summary),
  each failure a warning, never the run's.
- ``agreement``: a check that refuses on one rank refuses on every rank, in one line.

docs/runs.md describes what a run directory holds and how a run resumes.
"""
