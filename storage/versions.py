"""Published versions of a directory: `ROOT/versions/NNNN/` plus an atomically switched `ROOT/current`.

A new version starts as a hard-linked copy of the current one (files are only ever
replaced by rename, never rewritten in place, so a link is as good as a copy and
unchanged files stay byte-identical at no cost). A reader resolves `current` once
and keeps reading that version; the switch is a symlink renamed over the old one,
so a reader sees the old version or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from storage.atomic import _fsync_dir

VERSIONS = "versions"
CURRENT = "current"


def version_dirs(root: Path | str) -> list[Path]:
    """Finished version directories, oldest first."""
    base = Path(root) / VERSIONS
    if not base.is_dir():
        return []
    return sorted((p for p in base.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def current(root: Path | str) -> Path | None:
    """The version `current` points at, or None when nothing is published yet."""
    link = Path(root) / CURRENT
    if not link.is_symlink() and not link.exists():
        return None
    target = link.resolve()
    return target if target.is_dir() else None


def is_versioned(root: Path | str) -> bool:
    return (Path(root) / CURRENT).is_symlink() or (Path(root) / VERSIONS).is_dir()


def new_version(root: Path | str, source: Path | str | None = None) -> Path:
    """A new numbered version directory, hard-linked from `source` (default: the current version;
    none: empty). Subdirectories of the source are not copied."""
    root = Path(root)
    existing = version_dirs(root)
    number = int(existing[-1].name) + 1 if existing else 1
    target = root / VERSIONS / f"{number:04d}"
    source = current(root) if source is None else Path(source)
    target.mkdir(parents=True)
    if source is not None:
        for path in source.iterdir():  # fleet files only: not the lock, not a writer's temp files
            if path.is_file() and not path.is_symlink() and not path.name.startswith("."):
                _link_or_copy(str(path), str(target / path.name))
    return target


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def publish(root: Path | str, version: Path | str) -> Path:
    """Point `current` at `version` atomically (a new symlink renamed over the old one)."""
    root, version = Path(root), Path(version)
    link = root / CURRENT
    tmp = root / f".{CURRENT}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(version, root), tmp)
    os.replace(tmp, link)
    _fsync_dir(root)
    return version


def discard(version: Path | str) -> None:
    """Remove an unpublished version (a failed build)."""
    shutil.rmtree(version, ignore_errors=True)


def discard_unpublished(root: Path | str) -> list[str]:
    """Remove version directories newer than `current`: builds a writer died in (never published,
    so never read). Only the holder of the root's lock may call this."""
    live = current(root)
    if live is None and (Path(root) / CURRENT).is_symlink():
        return []  # a broken link: leave everything for the error that follows
    number = int(live.name) if live is not None and live.name.isdigit() else 0
    removed = []
    for path in version_dirs(root):
        if int(path.name) > number:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    if live is None:  # nothing was ever published: the root is what it was before the first build
        with contextlib.suppress(OSError):
            (Path(root) / VERSIONS).rmdir()
    return removed


def prune_versions(root: Path | str, keep: int = 3) -> list[str]:
    """Delete all but the newest `keep` versions (readers that resolved an older `current` keep
    reading it meanwhile); the current one always stays."""
    live = current(root)
    dirs = version_dirs(root)
    removed = []
    for path in dirs[: max(0, len(dirs) - keep)]:
        if live is not None and path.resolve() == live:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed
