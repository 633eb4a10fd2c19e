"""Bits per byte: a validation loss that does not change meaning with the tokenizer.

A loss in nats per token depends on how the tokenizer cuts text: a vocabulary that
needs fewer tokens for the same text has a higher loss per token at the same model
quality. Bits per UTF-8 byte of the text that the predicted tokens decode to does not,
so runs with different tokenizers or vocabularies compare (the unit of Gao et al.,
"The Pile", 2020, and of OLMo's in-loop evaluator):

    bpb = (loss per token in nats) x (tokens / bytes) / ln 2

The validation windows are the same at every evaluation of a run
(``collage_train.data.validation``), so their tokens and bytes are counted once. The
bytes are those of each window's predicted tokens decoded as one text: control tokens
(end of text) decode to nothing, and a SentencePiece window's leading space is dropped
by its decoder (at most one byte per window).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def target_text_size(tokenizer: Decoder, batch: torch.Tensor) -> tuple[int, int]:
    """(tokens, UTF-8 bytes) of the tokens a ``[rows, seq_len + 1]`` batch predicts."""
    targets = batch[:, 1:]
    num_bytes = sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets.tolist())
    return targets.numel(), num_bytes


def bits_per_byte(loss_nats_per_token: float, tokens: int, num_bytes: int) -> float | None:
    """The loss in bits per byte of text; None when the text has no bytes."""
    if num_bytes <= 0:
        return None
    return loss_nats_per_token * tokens / (num_bytes * math.log(2))
