"""Only ids the tokenizer can decode: generation never draws a padded row's id.

``model.vocab_size`` may pad the embedding past the tokenizer (to a multiple of 64 or 128
for faster GEMMs). The extra rows have ids no tokenizer piece has: SentencePiece refuses to
decode them, a transformers tokenizer silently drops them. Every generation of the package
(``collage_train.generate``: the command and the end-of-run sample; the downstream tasks'
``generate_until``, ``collage_train.evaluation.downstream``) passes ``decodable_only`` to
``model.generate``, which applies it before temperature, top-k or the greedy argmax.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList


class DecodableIds(LogitsProcessor):
    """Scores of the ids from ``vocab_size`` on become -inf; the others are left as they are."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[-1] <= self.vocab_size:
            return scores
        masked = scores.clone()
        masked[..., self.vocab_size :] = -torch.inf
        return masked


def decodable_only(vocab_size: int) -> LogitsProcessorList:
    """The ``logits_processor`` argument of ``model.generate`` for a tokenizer of
    ``vocab_size`` ids (one more than its largest)."""
    return LogitsProcessorList([DecodableIds(vocab_size)])
