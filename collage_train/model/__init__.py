"""The model: a transformers GPT-2, OPT or Llama built on the meta device (``build``),
its weights drawn unit by unit (``materialise``) or loaded from a local Hugging Face
directory (``init_from``) and cast to their storage dtype (``cast``); parameter shapes
(``shapes``); the chunked LM loss (``loss``; its block size, read without loading it:
``loss_settings``); the token ids generation may draw (``decodable``).

It knows nothing of precision strategies, engines or parallelism: those wrap the model
from outside (tests/test_import_graph.py).
"""
