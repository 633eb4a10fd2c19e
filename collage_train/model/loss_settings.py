"""``train.loss_chunk_tokens``: how many tokens the chunked loss (collage_train/model/loss.py)
takes per block, or none for the plain full-logits loss. Apart from the loss itself (no
torch), so that start-up validation and the memory planner read the setting without
loading the loss's autograd machinery."""

from __future__ import annotations

from typing import Any

from collage_train.errors import ConfigError

# auto: blocks whose fp32 logits take at most this many bytes (512 tokens at a 128256
# vocabulary, 8192 at 8192), a multiple of CHUNK_MULTIPLE tokens
AUTO_CHUNK_LOGITS_BYTES = 256 * 2**20
# auto on a CPU: blocks whose fp32 logits stay in the caches (256 tokens at 8192): the
# up-cast, log-softmax, exp and rounding passes over a block then run from cache instead
# of memory, which made the gpt_tiny step 10-15% faster in fp32 and 25% in emulated bf16
# than the plain loss's passes over the whole micro-batch's logits (docs/RESULTS.md,
# "CPU training step: native against fp32-emulated bf16 GEMMs")
CPU_AUTO_CHUNK_LOGITS_BYTES = 8 * 2**20
CHUNK_MULTIPLE = 64


def resolve_chunk_tokens(
    setting: Any, *, vocab_size: int, chunkable: bool, cpu: bool = False
) -> int | None:
    """Tokens per block for ``train.loss_chunk_tokens`` (``auto``, ``off`` or a positive
    number), or None for the plain full-logits loss.

    ``chunkable``: whether the run's LM head is a plain linear layer the chunked loss can
    compute (not Scalify's ScaledLinear). ``auto`` keeps such a head on the plain loss;
    a number is refused for it. ``cpu``: the run computes on a CPU, where ``auto`` sizes
    blocks for the caches (``CPU_AUTO_CHUNK_LOGITS_BYTES``) rather than for memory.
    """
    text = str(setting).strip()
    if text == "off":
        return None
    if text == "auto":
        if not chunkable:
            return None
        per_token = 4 * vocab_size
        budget = CPU_AUTO_CHUNK_LOGITS_BYTES if cpu else AUTO_CHUNK_LOGITS_BYTES
        tokens = budget // per_token // CHUNK_MULTIPLE * CHUNK_MULTIPLE
        return max(CHUNK_MULTIPLE, tokens)
    try:
        tokens = int(text)
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise ConfigError(
            f"train.loss_chunk_tokens must be auto, off or a positive number of tokens, "
            f"got {setting!r}"
        )
    if not chunkable:
        raise ConfigError(
            f"train.loss_chunk_tokens={tokens}: this precision's LM head is Scalify's scaled "
            "matmul, which the chunked loss does not compute; use train.loss_chunk_tokens="
            "auto or off (the full-logits loss)"
        )
    return tokens
