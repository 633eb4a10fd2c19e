"""Data pipeline: corpus sources, SentencePiece tokenizer, cached token shards and loaders."""

from collage_train.data.bundle import DataBundle, build_data
from collage_train.data.errors import DataError
from collage_train.data.loader import TokenLoader
from collage_train.data.tokenizer import Tokenizer

__all__ = ["DataBundle", "DataError", "TokenLoader", "Tokenizer", "build_data"]
