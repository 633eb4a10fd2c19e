"""Sources and file formats: documents, ordering, caps, fingerprints and input errors."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collage_train.data import DataError
from collage_train.data.settings import DataSettings
from collage_train.data.sources import Source, open_source, stdlib_files

MakeCfg = Callable[..., SimpleNamespace]


def source_for(make_cfg: MakeCfg, **overrides: object) -> Source:
    return open_source(DataSettings.from_config(make_cfg(**overrides)))


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the datasets library's cache inside the test's temporary directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def test_stdlib_source_lists_library_modules_only() -> None:
    files = stdlib_files()
    names = [f.name for f in files]
    assert len(files) > 300
    assert names == sorted(names)
    assert {"os.py", "json/decoder.py", "asyncio/events.py"} <= set(names)
    excluded = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    excluded.add("encodings")  # codec tables, mostly hex literals
    assert (Path(sysconfig.get_paths()["stdlib"]) / "encodings" / "cp1252.py").is_file()
    for name in names:
        parts = name.split("/")
        assert not excluded & set(parts), name
        assert not parts[-1].startswith("test_"), name
        assert parts[-1].endswith(".py")
    root = Path(sysconfig.get_paths()["stdlib"])
    assert all(f.path == root / f.name for f in files)


def test_stdlib_fingerprint_is_stable_and_metadata_complete(make_cfg: MakeCfg) -> None:
    source = source_for(make_cfg, source="stdlib", max_documents=3)
    assert (
        source.fingerprint() == source_for(make_cfg, source="stdlib", max_documents=3).fingerprint()
    )
    assert source.fingerprint() != source_for(make_cfg, source="stdlib").fingerprint()
    meta = source.metadata()
    assert meta["python_version"] == platform.python_version()
    assert meta["num_files"] > 300
    assert 5_000_000 < meta["bytes"] < 50_000_000
    documents = list(source.documents())
    assert len(documents) == 3
    assert documents[0] == stdlib_files()[0].path.read_text(encoding="utf-8", errors="replace")


def test_txt_directory_gives_one_document_per_file_in_order(
    tmp_path: Path, make_cfg: MakeCfg
) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n\n  indented\n")
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "notes.md").write_text("ignored: unsupported files inside directories")
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    documents = list(source_for(make_cfg, paths=[str(tmp_path)]).documents())
    assert documents == ["first\n\n  indented\n", "second\n", "third"]


def test_jsonl_gives_one_document_per_line(tmp_path: Path, make_cfg: MakeCfg) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"body": "one\n  two"}, {"body": "three", "id": 3}, {"body": None}]
    )
    source = source_for(make_cfg, paths=[str(path)], text_field="body")
    assert list(source.documents()) == ["one\n  two", "three"]


def test_parquet_reads_every_row_in_batches(tmp_path: Path, make_cfg: MakeCfg) -> None:
    rows = [f"row {i}\n\tindented" for i in range(2500)]
    pq.write_table(pa.table({"content": rows, "n": list(range(2500))}), tmp_path / "d.parquet")
    source = source_for(make_cfg, paths=[str(tmp_path / "d.parquet")], text_field="content")
    assert list(source.documents()) == rows


def test_mixed_paths_and_max_documents(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "a.txt").write_text("from txt")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "j1"}, {"text": "j2"}])
    pq.write_table(pa.table({"text": ["p1", "p2"]}), tmp_path / "c.parquet")
    paths = [str(tmp_path / "c.parquet"), str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    assert list(source_for(make_cfg, paths=paths).documents()) == [
        "p1",
        "p2",
        "from txt",
        "j1",
        "j2",
    ]
    capped = source_for(make_cfg, paths=paths, max_documents=3)
    assert list(capped.documents()) == ["p1", "p2", "from txt"]


def test_file_fingerprint_tracks_content_not_location(
    tmp_path: Path, make_cfg: MakeCfg, corpus_writer: Callable[..., Path]
) -> None:
    corpus = corpus_writer(tmp_path / "one", files=3)
    before = source_for(make_cfg, paths=[str(corpus)]).fingerprint()
    assert source_for(make_cfg, paths=[str(corpus)]).fingerprint() == before
    moved = shutil.copytree(corpus, tmp_path / "two")
    assert source_for(make_cfg, paths=[str(moved)]).fingerprint() == before
    assert source_for(make_cfg, paths=[str(corpus)], max_documents=2).fingerprint() != before
    assert source_for(make_cfg, paths=[str(corpus)], text_field="body").fingerprint() != before
    first = sorted(moved.glob("*.txt"))[0]
    first.write_text(first.read_text() + " ")
    assert source_for(make_cfg, paths=[str(moved)]).fingerprint() != before
    first.rename(moved / "renamed.txt")
    assert source_for(make_cfg, paths=[str(moved)]).fingerprint() != before


def test_files_metadata(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "a.txt").write_text("12345")
    meta = source_for(make_cfg, paths=[str(tmp_path)]).metadata()
    assert meta == {
        "source": "files",
        "num_files": 1,
        "bytes": 5,
        "max_documents": None,
        "paths": [str(tmp_path)],
    }


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_source_reads_local_json(
    tmp_path: Path, make_cfg: MakeCfg, hf_cache: None, streaming: bool
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a\n  b"}, {"text": "c"}, {"text": "d"}])
    source = source_for(
        make_cfg,
        source="hf",
        name="json",
        data_files=[str(path)],
        streaming=streaming,
        max_documents=2,
    )
    assert list(source.documents()) == ["a\n  b", "c"]
    assert source.metadata()["data_files"] == [str(path)]
    other = source_for(
        make_cfg, source="hf", name="json", data_files=[str(path)], streaming=streaming
    )
    assert other.fingerprint() != source.fingerprint()  # max_documents differs


def test_hf_fingerprint_follows_the_content_and_the_revision(
    tmp_path: Path, make_cfg: MakeCfg, hf_cache: None
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "first"}])
    before = source_for(make_cfg, source="hf", name="json", data_files=[str(path)])
    fingerprint = before.fingerprint()
    write_jsonl(path, [{"text": "first"}, {"text": "changed"}])
    os.utime(path, (1e9, 1e9))  # a new modification time, as any rewrite gives
    after = source_for(make_cfg, source="hf", name="json", data_files=[str(path)])
    assert after.fingerprint() != fingerprint
    assert list(after.documents()) == ["first", "changed"]
    pinned = source_for(
        make_cfg, source="hf", name="json", data_files=[str(path)], streaming=True, revision="v2"
    )
    assert pinned.metadata()["revision"] == "v2"
    unpinned = source_for(
        make_cfg, source="hf", name="json", data_files=[str(path)], streaming=True
    )
    assert pinned.fingerprint() != unpinned.fingerprint()


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_missing_text_field_names_columns(
    tmp_path: Path, make_cfg: MakeCfg, hf_cache: None, streaming: bool
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": "a", "id": 1}])
    source = source_for(
        make_cfg, source="hf", name="json", data_files=[str(path)], streaming=streaming
    )
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body', 'id'\]\)"):
        list(source.documents())


def test_hf_missing_data_file_raises(tmp_path: Path, make_cfg: MakeCfg, hf_cache: None) -> None:
    source = source_for(
        make_cfg, source="hf", name="json", data_files=[str(tmp_path / "missing.jsonl")]
    )
    with pytest.raises(DataError, match="could not load dataset 'json'"):
        list(source.documents())


def test_missing_path_raises(tmp_path: Path, make_cfg: MakeCfg) -> None:
    with pytest.raises(DataError, match=rf"^data\.paths: {tmp_path}/x\.txt does not exist$"):
        source_for(make_cfg, paths=[str(tmp_path / "x.txt")])


def test_unsupported_extension_raises(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "notes.md").write_text("text")
    with pytest.raises(DataError, match=r"unsupported extension '\.md'"):
        source_for(make_cfg, paths=[str(tmp_path / "notes.md")])


def test_directory_without_supported_files_raises(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "notes.md").write_text("text")
    with pytest.raises(DataError, match=r"contains no \.txt, \.jsonl or \.parquet files"):
        source_for(make_cfg, paths=[str(tmp_path)])


def test_all_documents_empty_raises(tmp_path: Path, make_cfg: MakeCfg) -> None:
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("\n  \n")
    write_jsonl(tmp_path / "c.jsonl", [{"text": ""}])
    source = source_for(make_cfg, paths=[str(tmp_path)])
    with pytest.raises(DataError, match=f"^no text found in {tmp_path}$"):
        list(source.documents())


def test_jsonl_errors(tmp_path: Path, make_cfg: MakeCfg) -> None:
    missing = write_jsonl(tmp_path / "m.jsonl", [{"text": "ok"}, {"body": "x"}])
    with pytest.raises(DataError, match=r"m\.jsonl:2: no field 'text' \(fields: \['body'\]\)"):
        list(source_for(make_cfg, paths=[str(missing)]).documents())
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        list(source_for(make_cfg, paths=[str(tmp_path / "bad.jsonl")]).documents())
    numbers = write_jsonl(tmp_path / "n.jsonl", [{"text": 5}])
    with pytest.raises(DataError, match="must be a string, not int"):
        list(source_for(make_cfg, paths=[str(numbers)]).documents())


def test_parquet_errors(tmp_path: Path, make_cfg: MakeCfg) -> None:
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), tmp_path / "d.parquet")
    source = source_for(make_cfg, paths=[str(tmp_path / "d.parquet")])
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body', 'n'\]\)"):
        list(source.documents())
    source = source_for(make_cfg, paths=[str(tmp_path / "d.parquet")], text_field="n")
    with pytest.raises(DataError, match="not string"):
        list(source.documents())
