"""The files ``AutoTokenizer.from_pretrained`` reads, written so that it gives training's ids.

transformers guesses wrong from a bare SentencePiece ``tokenizer.model``: it builds a GPT-2
style tokenizer that drops whitespace and appends a new end-of-text token. So every export
carries an explicit ``tokenizer.json`` (a Hugging Face ``tokenizers`` pipeline) and a
``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``, which loads that pipeline as is
(``save_tokenizer`` writes them next to the tokenizer's own file). For a SentencePiece BPE
model the pipeline is built here from the model's pieces: the spaces become ``▁`` (with a
prefix ``▁`` only if the model adds one; our trained model does not), the model's own
normalization map and whitespace collapsing are kept, the BPE model holds every piece with
one merge per way of splitting it into two pieces, ranked by the piece's score
(SentencePiece merges the highest-scoring adjacent pair first), unknown characters fall
back to byte pieces, user-defined pieces (``"\\n"``) are atomic added tokens, and the
control pieces (``<unk>``, ``<s>``, ``</s>``) are special tokens that literal text never
produces (``split_special_tokens``), as in SentencePiece.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collage_train.data.errors import DataError
from collage_train.data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer

SPACE_MARKER = "\u2581"
CONFIG_FILENAME = "tokenizer_config.json"
SPECIAL_TOKENS_FILENAME = "special_tokens_map.json"
TOKENIZER_FILENAME = "tokenizer.json"
BPE_MODEL_TYPE = 2
# SentencePiece piece types
PIECE_NORMAL, PIECE_UNKNOWN, PIECE_CONTROL, PIECE_USER_DEFINED = 1, 2, 3, 4


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike[str]) -> Path:
    """Write the tokenizer's own file plus the transformers files into ``directory``.

    ``AutoTokenizer.from_pretrained(directory)`` then encodes every text to the same ids
    and decodes them back. Returns the path of the tokenizer's own file.
    """
    target = tokenizer.copy_to(directory)
    write_transformers_files(tokenizer, Path(directory))
    return target


def write_transformers_files(tokenizer: Tokenizer, directory: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, SentencePieceTokenizer):
        tokenizer_json, config = sentencepiece_pipeline(tokenizer)
    elif isinstance(tokenizer, HFTokenizer):
        tokenizer_json, config = hf_pipeline(tokenizer)
    else:
        raise TypeError(f"cannot export a {type(tokenizer).__name__}")
    special = {
        key: config[key]
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if key in config
    }
    write_atomic(directory / TOKENIZER_FILENAME, tokenizer_json)
    write_atomic(directory / CONFIG_FILENAME, json.dumps(config, indent=2, ensure_ascii=False))
    write_atomic(directory / SPECIAL_TOKENS_FILENAME, json.dumps(special, indent=2))


def sentencepiece_pipeline(tokenizer: SentencePieceTokenizer) -> tuple[str, dict[str, Any]]:
    """A ``tokenizer.json`` and config equivalent to a SentencePiece BPE model."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers
    from tokenizers import Tokenizer as BackendTokenizer

    model = parse_sentencepiece_model(tokenizer.model_path.read_bytes())
    if model.model_type != BPE_MODEL_TYPE:
        raise DataError(
            f"tokenizer: {tokenizer.model_path} is not a SentencePiece BPE model (model type "
            f"{model.model_type}); only BPE models can be exported for transformers"
        )
    vocab = {piece: index for index, (piece, _, _) in enumerate(model.pieces)}
    mergeable = {piece for piece, _, kind in model.pieces if kind == PIECE_NORMAL}
    ranked = []
    for piece, score, kind in model.pieces:
        if kind != PIECE_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-score, vocab[piece], cut, left, right))
    ranked.sort()
    processor = tokenizer.processor
    unk = processor.id_to_piece(processor.unk_id())
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in ranked],
            unk_token=unk,
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    steps: list[Any] = []
    if model.precompiled_charsmap:
        steps.append(normalizers.Precompiled(model.precompiled_charsmap))
    if model.remove_extra_whitespaces:
        steps += [
            normalizers.Strip(left=True, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if model.add_dummy_prefix:
        steps.append(normalizers.Prepend(" "))
    if model.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE_MARKER))
    if steps:
        backend.normalizer = normalizers.Sequence(steps)
    decoding: list[Any] = [
        decoders.Replace(SPACE_MARKER, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if model.add_dummy_prefix:
        decoding.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decoding)
    controls = [p for p, _, kind in model.pieces if kind in (PIECE_CONTROL, PIECE_UNKNOWN)]
    backend.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in controls])
    user_defined = [p for p, _, kind in model.pieces if kind == PIECE_USER_DEFINED]
    backend.add_tokens([AddedToken(p, special=False, normalized=False) for p in user_defined])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": processor.id_to_piece(processor.eos_id()),
        "unk_token": unk,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if processor.bos_id() >= 0:
        config["bos_token"] = processor.id_to_piece(processor.bos_id())
    return backend.to_str(), config


@dataclass
class SentencePieceModel:
    """The fields of a SentencePiece ``ModelProto`` that the conversion needs."""

    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # piece, score, type
    model_type: int = 1  # UNIGRAM unless the trainer spec says otherwise
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    precompiled_charsmap: bytes = b""


def parse_sentencepiece_model(data: bytes) -> SentencePieceModel:
    """Read a serialized SentencePiece ``ModelProto`` (protobuf wire format, no protobuf needed).

    Fields (sentencepiece_model.proto): ModelProto 1 pieces, 2 trainer_spec, 3 normalizer_spec;
    SentencePiece 1 piece, 2 score, 3 type; TrainerSpec 3 model_type; NormalizerSpec
    2 precompiled_charsmap, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces.
    """
    model = SentencePieceModel()
    for number, value in wire_fields(data):
        if number == 1 and isinstance(value, bytes):
            piece, score, kind = "", 0.0, PIECE_NORMAL
            for sub_number, sub_value in wire_fields(value):
                if sub_number == 1 and isinstance(sub_value, bytes):
                    piece = sub_value.decode("utf-8")
                elif sub_number == 2 and isinstance(sub_value, bytes):
                    (score,) = struct.unpack("<f", sub_value)
                elif sub_number == 3 and isinstance(sub_value, int):
                    kind = sub_value
            model.pieces.append((piece, score, kind))
        elif number == 2 and isinstance(value, bytes):
            for sub_number, sub_value in wire_fields(value):
                if sub_number == 3 and isinstance(sub_value, int):
                    model.model_type = sub_value
        elif number == 3 and isinstance(value, bytes):
            for sub_number, sub_value in wire_fields(value):
                if sub_number == 2 and isinstance(sub_value, bytes):
                    model.precompiled_charsmap = sub_value
                elif sub_number == 3 and isinstance(sub_value, int):
                    model.add_dummy_prefix = bool(sub_value)
                elif sub_number == 4 and isinstance(sub_value, int):
                    model.remove_extra_whitespaces = bool(sub_value)
                elif sub_number == 5 and isinstance(sub_value, int):
                    model.escape_whitespaces = bool(sub_value)
    return model


def wire_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """Yield ``(field number, value)`` of a protobuf message: ints for varints, else bytes."""
    position = 0
    while position < len(data):
        key, position = read_varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = read_varint(data, position)
            yield number, value
        elif wire_type == 2:
            length, position = read_varint(data, position)
            yield number, data[position : position + length]
            position += length
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            yield number, data[position : position + width]
            position += width
        else:
            raise DataError(f"not a SentencePiece model (protobuf wire type {wire_type})")


def read_varint(data: bytes, position: int) -> tuple[int, int]:
    """Decode the base-128 varint at ``position``; return it and the next position."""
    value = shift = 0
    while True:
        if position >= len(data):
            raise DataError("not a SentencePiece model (truncated protobuf varint)")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


def hf_pipeline(tokenizer: HFTokenizer) -> tuple[str, dict[str, Any]]:
    """The tokenizer's own ``tokenizer.json``; its config, loaded as the plain fast class.

    A model-specific class (``LlamaTokenizer``...) may rebuild the pipeline from its own
    defaults in some transformers versions; ``PreTrainedTokenizerFast`` uses the file as is.
    """
    config = dict(tokenizer.config or {"clean_up_tokenization_spaces": False})
    config.pop("auto_map", None)  # never point transformers at remote code
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["eos_token"] = tokenizer.eot_token
    config["split_special_tokens"] = True  # as in training: literal special tokens are text
    return tokenizer.tokenizer_json, config


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
    os.replace(tmp, path)
