"""The run's configuration: the typed schema Hydra composes ``configs/`` into
(``schema``), which schema each option of a config group uses and where the config files
are (``options``), and docs/config.md generated from the schema (``reference``:
``python -m collage_train.config.reference > docs/config.md``).

The YAML files are configs/ at the top of the repository; the wheel ships them inside
the package, as its ``configs`` folder (pyproject.toml's package-dir).
"""
