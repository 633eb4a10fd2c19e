"""Exported tokenizers load in ``AutoTokenizer.from_pretrained`` with training's exact ids.

Covers the trained SentencePiece model, a SentencePiece model with the library's default
options (dummy prefix, NFKC, whitespace collapsing) given as ``data.tokenizer``, and a
Hugging Face byte-level BPE given as a directory or as a lone ``tokenizer.json``.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from collage_train.data import DataError, Tokenizer
from collage_train.data.hf_files import save_tokenizer
from collage_train.data.tokenizer import HFTokenizer, SentencePieceTokenizer

TEXTS = [
    "def f(x):\n    return x\n",
    "class A:\n\tdef g(self):\n\t\tif True:\n            pass  # trailing   \n\n\n",
    "   leading spaces and a  double   gap",
    "unicode: é ü 中文 😀 \u00a0nbsp ∑ ß",
    "literal specials <s> </s> <unk> <|endoftext|> <0x41>",
    "windows\r\nline ends\r\n",
    "digits 1234567890 x1y22",
    "",
]
EOT = "<|endoftext|>"


def corpus_texts(code_corpus: Path, count: int = 12) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(code_corpus.glob("*.txt"))[:count]]


@pytest.fixture(scope="module")
def default_sentencepiece(code_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SentencePiece BPE trained with the library's default normalization options."""
    lines = [line for text in corpus_texts(code_corpus, 60) for line in text.splitlines()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in lines if line.strip()]),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp_default") / "other.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def byte_level_dir(code_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GPT-2 style byte-level BPE (tokenizers library) saved as a transformers directory."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(corpus_texts(code_corpus, 60), trainer=trainer)
    directory = tmp_path_factory.mktemp("byte_level")
    backend.save(str(directory / "tokenizer.json"))
    # A model-specific class must not leak into the export: it is replaced by the fast class.
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOT, "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def lone_tokenizer_json(byte_level_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "lone" / "tokenizer.json"
    target.parent.mkdir()
    target.write_bytes((byte_level_dir / "tokenizer.json").read_bytes())
    return target


@pytest.mark.parametrize("kind", ["trained", "sentencepiece_defaults", "hf_dir", "hf_json"])
def test_auto_tokenizer_gives_training_ids_and_decodes_back(
    kind: str,
    request: pytest.FixtureRequest,
    code_corpus: Path,
    tmp_path: Path,
) -> None:
    if kind == "trained":
        tokenizer: Tokenizer = request.getfixturevalue("small_tokenizer")
    elif kind == "sentencepiece_defaults":
        tokenizer = Tokenizer.load(request.getfixturevalue("default_sentencepiece"))
    elif kind == "hf_dir":
        tokenizer = Tokenizer.load(request.getfixturevalue("byte_level_dir"))
    else:
        tokenizer = Tokenizer.load(
            lone_tokenizer_json(request.getfixturevalue("byte_level_dir"), tmp_path)
        )
    assert isinstance(tokenizer, HFTokenizer if kind.startswith("hf") else SentencePieceTokenizer)
    lossless = kind != "sentencepiece_defaults"  # NFKC and whitespace collapsing lose text

    save_tokenizer(tokenizer, tmp_path / "hf")
    auto = AutoTokenizer.from_pretrained(tmp_path / "hf")
    reloaded = Tokenizer.load(tmp_path / "hf")
    assert auto.eos_token_id == tokenizer.eot_id == reloaded.eot_id
    assert len(auto) == tokenizer.vocab_size
    for text in TEXTS + corpus_texts(code_corpus):
        ids = tokenizer.encode(text)
        assert auto.encode(text, add_special_tokens=False) == ids, text
        assert auto(text)["input_ids"] == ids, text  # no BOS/EOS template either
        assert reloaded.encode(text) == ids
        decoded = auto.decode([*ids, tokenizer.eot_id], skip_special_tokens=True)
        if lossless:
            assert decoded == text
        elif tokenizer.processor.unk_id() not in ids:  # type: ignore[attr-defined]
            assert decoded == tokenizer.decode(ids)


def test_end_of_text_of_a_hf_tokenizer(byte_level_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.load(byte_level_dir)
    assert tokenizer.eot_id == 1 and tokenizer.vocab_size == 400
    assert tokenizer.encode(EOT) != [tokenizer.eot_id]  # literal text is never the separator
    assert tokenizer.decode([*tokenizer.encode("x = 1"), tokenizer.eot_id]) == "x = 1"
    # the one-file bundle (what caches and checkpoints copy) keeps the end-of-text token
    bundle = tokenizer.copy_to(tmp_path / "cache")
    assert bundle.name == "hf_tokenizer.json"
    assert Tokenizer.load(bundle).eot_id == 1
    assert Tokenizer.load(bundle).sha256() == Tokenizer.load(tmp_path / "cache").sha256()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x01 not a model", r"is neither a SentencePiece model nor a tokenizer\.json"),
        (b'{"not": "a tokenizer"}', r"is not a Hugging Face tokenizer\.json"),
        (b"{broken json", r"is not valid JSON"),
    ],
)
def test_a_file_that_is_not_a_tokenizer_raises(
    content: bytes, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "tok.bin"
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"^tokenizer: .*" + message):
        Tokenizer.load(path)


def test_a_directory_without_a_tokenizer_raises(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"holds no tokenizer\.json or tokenizer\.model"):
        Tokenizer.load(tmp_path)


def test_a_hf_tokenizer_without_end_of_text_raises(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models

    BackendTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(
        str(tmp_path / "tokenizer.json")
    )
    with pytest.raises(DataError, match="names no end-of-text token"):
        Tokenizer.load(tmp_path)
