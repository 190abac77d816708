"""Hostile corpus files: whatever the bytes, ingest accepts exact text or refuses with a CorpusError naming the file.

Policy: a corpus file is UTF-8 text (a leading BOM dropped) with at least one non-space
character, no NUL byte and at most `max_bytes`; control characters and very long lines
are text and are kept. A file found in a corpus directory must resolve inside it: a
symbolic link out of the directory is refused (a file outside may be given explicitly).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cartridges.core.errors import CorpusError
from jobs.fleet import fleet_files
from schemas import IngestConfig
from stages import ingest
from stages.job import Job
from storage import Store
from tests.tiny import tiny_tokenizer

pytestmark = pytest.mark.reliability
TOKENIZER = tiny_tokenizer()
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def expected(data: bytes) -> str | None:
    """What ingest must return for a file with these bytes, None when it must refuse it."""
    if b"\x00" in data:
        return None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        return None
    return text if text.strip() else None


def ingest_bytes(data: bytes, name: str = "doc.md", config: IngestConfig = IngestConfig()):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "corpus"
        root.mkdir()
        (root / name).write_bytes(data)
        try:
            files = ingest.collect([root], config)
        except CorpusError as exc:
            assert str(root / name) in str(exc) and "\n" not in str(exc)
            return None
        rows = ingest.document_rows(files, TOKENIZER)
        assert rows[0]["tokens"] >= 1 and rows[0]["chars"] == len(files[0].text)
        return files[0].text


@PROPS
@given(data=st.binary(max_size=3000))
def test_random_bytes(data):
    assert ingest_bytes(data) == expected(data)


controls = st.characters(min_codepoint=0, max_codepoint=0x9F) | st.characters(blacklist_categories=("Cs",))


@PROPS
@given(text=st.text(controls, max_size=400), bom=st.booleans())
def test_text_with_control_characters_and_any_script(text, bom):
    data = ("\ufeff" if bom else "").encode() + text.encode("utf-8")
    assert ingest_bytes(data) == expected(data)


@PROPS
@given(parts=st.lists(st.tuples(st.text(max_size=40), st.sampled_from(["utf-8", "latin-1", "utf-16", "cp1252"])),
                      min_size=1, max_size=5))
def test_mixed_encodings_in_one_file(parts):
    data = b""
    for text, encoding in parts:
        data += text.encode(encoding, errors="replace")
    assert ingest_bytes(data) == expected(data)


@pytest.mark.parametrize("data", [b"", b" ", b"\n\n\t \r\n", "\ufeff".encode(), "\ufeff \n".encode()])
def test_empty_and_blank_files_are_refused(data):
    with pytest.raises(AssertionError):  # no text: refused (ingest_bytes returns None)
        assert ingest_bytes(data) is not None


def test_huge_lines_are_text_and_oversized_files_are_refused():
    line = ("word " * 60_000).encode()  # one 300 kB line
    assert ingest_bytes(line) == line.decode()
    assert ingest_bytes(line, config=IngestConfig(max_bytes=100_000)) is None


def test_symlinks_out_of_the_corpus_directory_are_refused(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("a file outside the corpus. " * 10)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "ok.md").write_text("inside the corpus. " * 10)
    (corpus / "sub" / "inner.md").write_text("also inside. " * 10)
    os.symlink(corpus / "sub" / "inner.md", corpus / "link-inside.md")  # inside: fine (deduplicated)
    assert len(ingest.collect([corpus])) == 2  # the link and its target are one document
    os.symlink(outside, corpus / "notes.md")
    for collect in (lambda: ingest.collect([corpus]), lambda: fleet_files([corpus])):
        with pytest.raises(CorpusError, match=r"notes\.md: symbolic link to .*secret\.txt, outside the corpus"):
            collect()
    os.unlink(corpus / "notes.md")
    os.symlink(tmp_path, corpus / "sub" / "up")  # a directory link out of the corpus
    os.symlink(outside.parent, corpus / "parent")
    try:
        files = ingest.collect([corpus])
    except CorpusError as exc:
        assert "outside the corpus" in str(exc)
    else:
        assert all(f.path.resolve().is_relative_to(corpus.resolve()) for f in files)
    assert [f.name for f in ingest.collect([outside])] == ["secret.txt"]  # given explicitly: read


def test_a_refused_file_writes_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("good text here. " * 10)
    (corpus / "b.md").write_bytes(b"\xff\xfe\x00binary")
    store = Store(tmp_path / "store")
    with pytest.raises(CorpusError, match=r"b\.md: binary file"):
        ingest.run(Job(store, corpus=(corpus,), tokenizer=TOKENIZER))
    assert store.catalog.artifacts() == []
