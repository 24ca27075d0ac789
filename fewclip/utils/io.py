"""Atomic file writes: a reader never sees a half-written result.

Every result file goes to a temporary name in the same directory first and is
then renamed into place (`os.replace` is atomic on POSIX and Windows), so an
interrupted run leaves either the old file or the new one, never a torn one.
The file's data is fsynced before the rename and the directory entry after it,
so once ``atomic_write`` returns the file survives a power cut too (what a
finished-run record in ``fewclip.runs.records`` relies on).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make the entries of ``folder`` (a rename, a new or removed file) durable; a no-op where directories
    cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_OS_ERROR = re.compile(r"os error (\d+)")


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` atomically (data and entry fsynced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        try:
            write(tmp)
        except OSError as e:
            if e.filename is None:  # name the file for the message (a full disk, a size limit)
                raise OSError(e.errno, e.strerror, str(path)) from e
            raise
        except Exception as e:
            # Writers in other languages (safetensors) report a failed write as their own error type with
            # "(os error N)" in the message; make it the OSError it is, so the cause is named.
            m = _OS_ERROR.search(str(e))
            if m:
                raise OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(path)) from e
            raise
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; results are ordinary files
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, _write)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
