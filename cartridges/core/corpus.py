"""Reading corpus files with clear errors for every way a file can be unusable."""

from __future__ import annotations

from pathlib import Path

from cartridges.core.errors import CorpusError

MAX_BYTES = 16 * 1024 * 1024
EXTENSIONS = (".md", ".txt")


def read_text(path: str | Path, max_bytes: int = MAX_BYTES) -> str:
    """UTF-8 text of one file; missing, oversized, binary, non-UTF-8 or empty is an error."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory")
    if not path.is_file():
        raise CorpusError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size > max_bytes:
        raise CorpusError(f"{path}: {size} bytes is over the {max_bytes}-byte limit per file")
    data = path.read_bytes()
    if b"\x00" in data:
        raise CorpusError(f"{path}: binary file (contains NUL bytes), expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise CorpusError(f"{path}: empty file (no text)")
    return text


def check_inside(path: Path, root: Path) -> Path:
    """A file found in a corpus directory must be inside it, symbolic links resolved.

    A link out of the directory is refused rather than followed: a corpus directory is a
    boundary (a link to /etc/passwd named notes.md must not end up in a cartridge). A file
    outside can still be given explicitly.
    """
    target = path.resolve()
    if not target.is_relative_to(root.resolve()):
        raise CorpusError(f"{path}: symbolic link to {target}, outside the corpus directory {root}; "
                          "copy the file in or give it explicitly")
    return path


def expand(paths: list[str | Path], extensions: tuple[str, ...] = EXTENSIONS) -> list[Path]:
    """Files and directories (their .md/.txt files, sorted, recursively) as a list of files."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in extensions)
            if not found:
                raise CorpusError(f"{path}: directory has no {'/'.join(extensions)} files")
            out += [check_inside(p, path) for p in found]
        elif path.exists() or path.is_symlink():
            out.append(path)
        else:
            raise CorpusError(f"{path}: no such file or directory")
    return out


def document_text(name: str, text: str, multi: bool) -> str:
    """A document as it appears in a corpus; multi-document corpora get a header line."""
    return f"Document: {name}\n\n{text.strip()}\n" if multi else text


def corpus_text(paths: list[str | Path]) -> str:
    """One text for a list of files/directories, documents separated by headers."""
    files = expand(paths)
    multi = len(files) > 1
    return "\n".join(document_text(f.name, read_text(f), multi) for f in files)
