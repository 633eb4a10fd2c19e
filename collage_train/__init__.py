"""collage_train: LLM pre-training with light-weight low-precision strategies.

Run ``python -m collage_train`` for the default (a tiny GPT on the embedded Python
standard-library corpus); see README.md and the docs/ pages it lists for models,
precisions, data and logging.
"""

__version__ = "0.1.0"
