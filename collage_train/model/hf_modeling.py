"""transformers' modeling classes, imported without the quantization libraries it probes.

Import ``AutoModelForCausalLM``, ``PreTrainedModel`` and ``AttentionInterface`` from here,
never from transformers: the first import of ``transformers.modeling_utils`` builds its
quantizer registry, which imports an installed torchao (seconds, and warnings ahead of a
run's own lines). Here that first import finds no torchao, so transformers in this process
treats it as absent (collage_train loads no torchao-quantized checkpoint); an already
imported torchao is left as it is, and torchao stays importable for everyone else.
Why and what it saves: docs/design.md, "Importing transformers".
"""

from __future__ import annotations

import importlib
import sys

UNUSED_BACKENDS = ("torchao",)


def import_without(module: str, hidden: tuple[str, ...]) -> None:
    """Import ``module`` (once) while the ``hidden`` packages that are not imported yet look
    uninstalled (``None`` in ``sys.modules``: ``importlib.util.find_spec`` answers None and
    an import fails); on return they are importable again."""
    if module in sys.modules:
        return
    absent = [name for name in hidden if name not in sys.modules]
    for name in absent:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        importlib.import_module(module)
    finally:
        for name in absent:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


import_without("transformers.modeling_utils", UNUSED_BACKENDS)

from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModelForCausalLM,
    PreTrainedModel,
)

__all__ = ["AttentionInterface", "AutoModelForCausalLM", "PreTrainedModel"]
