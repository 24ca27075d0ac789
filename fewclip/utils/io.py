"""Atomic file writes: a reader never sees a half-written result.

Every result file goes to a temporary name in the same directory first and is
then renamed into place (`os.replace` is atomic on POSIX and Windows), so an
interrupted run leaves either the old file or the new one, never a torn one.
The file's data is fsynced before the rename and the directory entry after it,
so once ``atomic_write`` returns the file survives a power cut too (what a
finished-run record in ``fewclip.runs.records`` relies on).
"""
from __future__ import annotations

import errno
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


def os_error_of(e: BaseException, path: str | os.PathLike) -> OSError | None:
    """The OSError behind ``e``, naming ``path``, where ``e`` is a writer's own error type for a failed write:
    writers in other languages (safetensors) say "(os error N)" in the message. None for any other error."""
    m = _OS_ERROR.search(str(e))
    if not m:
        return None
    out = OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(path))
    out.__cause__ = e
    return out


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` and move the result to ``path`` atomically (data and entry fsynced)."""
    path = Path(path)
    if path.is_dir():  # else the rename would fail naming the temporary file, not the path the user gave
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # the folder cannot take a new file: name the file the caller asked for
        raise OSError(e.errno, e.strerror, str(path)) from e
    os.close(fd)
    try:
        try:
            write(tmp)
        except OSError as e:
            if e.filename is None:  # name the file for the message (a full disk, a size limit)
                raise OSError(e.errno, e.strerror, str(path)) from e
            raise
        except Exception as e:  # a writer's own type for a failed write (safetensors'): the OSError it is
            raise os_error_of(e, path) or e
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; results are ordinary files
        _fsync_file(tmp)
        try:
            os.replace(tmp, path)
        except OSError as e:  # (a folder made at path meanwhile, ...): name the path, not the temporary file
            raise OSError(e.errno, e.strerror, str(path)) from e
    except BaseException:  # Ctrl-C included: never leave the temporary file; the error goes on unchanged
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
