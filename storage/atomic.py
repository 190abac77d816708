"""Atomic file writes: a reader sees the old file or the whole new one, never a torn one."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from storage.faults import fault_point

TMP_SUFFIX = ".tmp"
FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_temp(path: Path) -> bool:
    """True for the in-progress files ``atomic_path`` creates (hidden, ``.tmp``)."""
    return path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path``, on error it is removed.

    The temp file sits in the same directory so ``os.replace`` is a same-filesystem
    rename. Both the file and the directory are fsynced so a crash right after the
    rename cannot leave an empty file behind.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fault_point(f"atomic.write.{target.name}")  # the temp file is whole, the target untouched
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in FULL and exc.filename is None:  # say which file
            raise OSError(exc.errno, os.strerror(exc.errno), str(target)) from exc
        raise
    _fsync_dir(target.parent)


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json_atomic(path: Path | str, obj: Any) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return atomic_write_bytes(path, (text + "\n").encode("utf-8"))
