"""What the command line prints when something goes wrong: one message naming the problem and the fix.

Every error a user can cause ends a command with one line on stderr and a non-zero exit code: 2 for
a bad input (config, data, file, command line, a directory holding another run), 1 for a run that
could not finish (a diverged training, a full disk, an unwritable or busy directory) and for an
unexpected error, 130 for an interrupt. ``--debug`` anywhere on the command line, or the environment
variable ``FEWCLIP_DEBUG=1``, prints the Python trace as well.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from fewclip.utils import env

DEBUG_ENV = env.DEBUG
DEBUG_FLAG = "--debug"


class FewclipError(Exception):
    """Base of every error a user can cause; its message names the problem and the fix. Each module raises its
    own subclass; ``exit_code`` is what the command line exits with."""

    exit_code = 1


class InputError(FewclipError, ValueError):
    """A bad input: config, data, file, command line, a directory holding another run (exit 2)."""

    exit_code = 2


class RunFailure(FewclipError, RuntimeError):
    """A run that could not finish: a diverged training, an unwritable or busy directory (exit 1)."""

    exit_code = 1


class RunError(RunFailure):
    """A run that cannot start or cannot be recorded as finished; the message says what to do."""


class NonFiniteError(RunError):
    """A NaN or infinite loss, metric or adapter tensor."""


def take_debug_flag(args: Sequence[str]) -> tuple[bool, list[str]]:
    """(debug requested, the arguments without ``--debug``)."""
    rest = [a for a in args if a != DEBUG_FLAG]
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return env or len(rest) != len(args), rest


# OSErrors about the shape of a path the user gave (a folder where a file goes, a file in the way, a link loop,
# a name too long): bad input, exit 2. A full disk, a read-only or unwritable folder: a failed run, exit 1.
PATH_ERRORS = (errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ELOOP, errno.ENAMETOOLONG)


def os_error_message(e: OSError) -> str:
    """An OSError as the problem and what to do about it."""
    name = e.filename
    at = f" {name}" if name else ""
    code = e.errno
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return (f"no space left on the device (or quota exceeded) writing{at}: free some space or choose another "
                f"out= folder. Finished runs are kept, and a sweep resumes where it stopped")
    if code == errno.EFBIG:
        return (f"file too large writing{at}: a file size limit (`ulimit -f`) or the filesystem's; raise the limit or "
                f"choose another out= folder")
    if code == errno.EROFS:
        return f"cannot write{at}: the file system is read-only; choose a writable out= folder"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied:{at}; choose a folder you can write to (out=) or fix its permissions"
    if code == errno.ELOOP:
        return f"{name}: a symbolic link loop (too many levels of symbolic links); remove or fix the link"
    if code == errno.ENOTDIR:
        return f"{name}: a file stands where a folder is expected; give a folder path, or move the file away"
    if code == errno.EISDIR:
        return f"{name} is a folder where a file is expected; give a file path"
    if code == errno.EEXIST:
        return (f"{name} already exists and is in the way (a file where a folder is needed?); move it or choose "
                f"another path")
    if code == errno.ENAMETOOLONG:
        return f"file name too long: {name}; choose a shorter path"
    if code == errno.ENOENT:
        return f"no such file or folder: {name}" if name else f"{e.strerror}"
    return f"{e.strerror or e}{':' + at if at else ''}"


def describe(e: BaseException) -> tuple[str, int]:
    """(message, exit code) for an error that ended a command."""
    if isinstance(e, FewclipError):
        return str(e), e.exit_code
    if isinstance(e, OSError):  # a path that cannot be what it must be is a bad input; the rest, a failed run
        return os_error_message(e), 2 if e.errno in PATH_ERRORS else 1
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch's CUDA OOM too
        return "out of memory: use smaller batches (data.batch_size=..., train.batch_size=...) or a smaller backbone", 1
    return (f"unexpected {type(e).__name__}: {e}. This is likely a bug in fewclip: rerun with {DEBUG_FLAG} (or "
            f"{DEBUG_ENV}=1) to see where it happened, and please report it"), 1
