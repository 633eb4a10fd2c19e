"""collage_train/model/loss_settings.py: the chunked loss's block size from
``train.loss_chunk_tokens``, read without loading the loss itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from collage_train.errors import ConfigError
from collage_train.model.loss_settings import resolve_chunk_tokens


def test_auto_sizes_blocks_from_the_vocabulary():
    assert resolve_chunk_tokens("auto", vocab_size=128256, chunkable=True) == 512
    assert resolve_chunk_tokens("auto", vocab_size=50257, chunkable=True) == 1280
    assert resolve_chunk_tokens("auto", vocab_size=8192, chunkable=True) == 8192
    assert resolve_chunk_tokens("auto", vocab_size=10**9, chunkable=True) == 64
    assert resolve_chunk_tokens("auto", vocab_size=128256, chunkable=False) is None  # Scalify
    assert resolve_chunk_tokens("off", vocab_size=128256, chunkable=True) is None
    assert resolve_chunk_tokens("100", vocab_size=128256, chunkable=True) == 100
    # on a CPU, blocks of at most 8 MiB of fp32 logits (the caches), at least 64 tokens
    assert resolve_chunk_tokens("auto", vocab_size=8192, chunkable=True, cpu=True) == 256
    assert resolve_chunk_tokens("auto", vocab_size=2048, chunkable=True, cpu=True) == 1024
    assert resolve_chunk_tokens("auto", vocab_size=128256, chunkable=True, cpu=True) == 64
    assert resolve_chunk_tokens("auto", vocab_size=8192, chunkable=False, cpu=True) is None
    assert resolve_chunk_tokens("100", vocab_size=8192, chunkable=True, cpu=True) == 100


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1.5", "True"])
def test_a_block_size_that_is_no_count_is_one_config_error(value):
    with pytest.raises(ConfigError, match="auto, off or a positive number") as err:
        resolve_chunk_tokens(value, vocab_size=512, chunkable=True)
    assert "\n" not in str(err.value)


def test_start_up_validation_reads_it_without_the_loss_or_torchdynamo():
    """The loss module's ``torch.compiler.disable`` imports TorchDynamo (about a second):
    a refused setting is reported before any of it loads."""
    code = (
        "import sys, collage_train.run.validate, collage_train.plan; "
        "print(sorted(m for m in ('collage_train.model.loss', 'torch._dynamo')"
        " if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
