"""Tokenizer: exact round-trips of code and whitespace, newline handling, save/load, training."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collage_train.data import DataError, Tokenizer
from collage_train.data.hf_files import save_tokenizer
from collage_train.data.tokenizer import (
    MAX_SENTENCE_CHARS,
    TokenizerSettings,
    split_after_newlines,
    train_model,
    training_sentences,
)

TRICKY_TEXTS = [
    "def f(x):\n\treturn x\n",
    "class A:\n    def g(self):\n        if True:\n            pass\n",
    "\n",
    "\n\n\n",
    "   leading spaces",
    "trailing spaces   \n   \n",
    "a  b   c    d\t\te",
    "\t\t\n\t \t\n",
    "windows\r\nline\r\nends\r\n",
    "unicode: é ü 中文 😀 \u00a0nbsp",
    "literal specials <s> </s> <unk> <0x41>",
    "x" * 10_000 + "\n" + " " * 300 + "y",
    "",
]


def test_round_trips_tricky_texts(small_tokenizer: Tokenizer) -> None:
    for text in TRICKY_TEXTS:
        assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_round_trips_corpus_documents(small_tokenizer: Tokenizer, code_corpus: Path) -> None:
    for path in sorted(code_corpus.glob("*.txt"))[:20]:
        text = path.read_text(encoding="utf-8")
        assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(
    st.text(
        alphabet=st.one_of(
            st.sampled_from(" \t\n\r"),
            st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581"),
        ),
        max_size=200,
    )
)
def test_round_trips_arbitrary_text(small_tokenizer: Tokenizer, text: str) -> None:
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_special_ids(small_tokenizer: Tokenizer) -> None:
    assert small_tokenizer.vocab_size == 512
    assert small_tokenizer.eot_id == 2
    assert small_tokenizer.decode([small_tokenizer.eot_id]) == ""
    ids = small_tokenizer.encode("unseen: 😀 ∑ ß\x00")
    assert 0 not in ids and small_tokenizer.eot_id not in ids


def test_newline_is_one_atomic_token(small_tokenizer: Tokenizer) -> None:
    newline_id = 3
    assert small_tokenizer.decode([newline_id]) == "\n"
    assert small_tokenizer.encode("\n\n\n") == [newline_id] * 3
    assert small_tokenizer.encode("x = 1\n    y") == [
        *small_tokenizer.encode("x = 1"),
        newline_id,
        *small_tokenizer.encode("    y"),
    ]
    for token_id in range(small_tokenizer.vocab_size):
        piece = small_tokenizer.decode([token_id])
        assert "\n" not in piece or piece == "\n"


def test_indentation_is_compressed(small_tokenizer: Tokenizer) -> None:
    assert len(small_tokenizer.encode("    ")) == 1
    assert len(small_tokenizer.encode("        ")) == 1


def test_encode_batch_matches_encode(small_tokenizer: Tokenizer) -> None:
    assert small_tokenizer.encode_batch(TRICKY_TEXTS) == [
        small_tokenizer.encode(text) for text in TRICKY_TEXTS
    ]


def test_pieces_split_after_newlines_encode_exactly(
    small_tokenizer: Tokenizer, code_corpus: Path
) -> None:
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(code_corpus.glob("*.txt"))[:5])
    pieces = list(split_after_newlines(text, 500))
    assert len(pieces) > 10
    assert "".join(pieces) == text
    assert all(piece.endswith("\n") for piece in pieces[:-1])
    joined = [i for ids in small_tokenizer.encode_batch(pieces) for i in ids]
    assert joined == small_tokenizer.encode(text)


def test_save_and_load(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    saved = save_tokenizer(small_tokenizer, tmp_path / "out")
    assert saved == tmp_path / "out" / "tokenizer.model"
    assert saved.read_bytes() == small_tokenizer.model_path.read_bytes()
    text = TRICKY_TEXTS[1]
    assert Tokenizer.load(tmp_path / "out").encode(text) == small_tokenizer.encode(text)
    assert Tokenizer.load(saved).model_path == saved


def test_load_missing_model_raises(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope.model")


def test_training_sentences_respect_budget_and_have_no_newlines() -> None:
    documents = ["ab\ncd\n\n", "x" * (MAX_SENTENCE_CHARS + 5) + "\nlast line", "never read"]
    sentences = training_sentences(documents, max_chars=7 + MAX_SENTENCE_CHARS + 5 + 1 + 4)
    assert sentences == ["ab", "cd", "x" * MAX_SENTENCE_CHARS, "xxxxx", "last"]
    assert training_sentences(["abcdef"], max_chars=3) == ["abc"]


def test_vocab_too_large_for_corpus_raises() -> None:
    with pytest.raises(DataError, match=r"data\.vocab_size"):
        train_model(["tiny corpus"] * 10, TokenizerSettings(vocab_size=5000, train_chars=100))
