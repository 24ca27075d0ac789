"""Cross-host folder locks: who may write a run directory, a sweep's files or a feature-store group.

A run directory is written only by the process that holds its lock file ``.fewclip.lock``
(:class:`RunLock`): created atomically (a hard link of a complete file, which fails if the lock
exists, also on NFS), holding host, boot id, pid, the process's start time and creation time. The
holder touches it every ``heartbeat_s`` seconds. A lock is stale, and is broken by the next
claimant, when its process is gone: on the same host (same boot), when its pid no longer runs (or
runs another process, by start time); from another host or an earlier boot, when it has not been
touched for ``stale_after_s`` seconds (default ``DEFAULT_STALE_AFTER_S``, or the environment
variable ``FEWCLIP_LOCK_TIMEOUT_S``; choose it well above the clock skew between hosts).

``fewclip.runs.records`` builds run claims on it (``claim_run``, ``open_run``); ``fewclip.features.store`` uses it for
feature-store groups and ``fewclip.runs.sweep`` for a sweep's own files.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fewclip.utils import env
from fewclip.utils.errors import RunFailure

log = logging.getLogger(__name__)

LOCK_FILE = ".fewclip.lock"
DEFAULT_STALE_AFTER_S = 600.0
LOCK_TIMEOUT_ENV = env.LOCK_TIMEOUT_S


class LockError(RunFailure):
    """A lock that cannot be taken or configured; the message says what to do."""


class RunLockedError(LockError):
    """Another live process holds the folder's lock."""


def default_stale_after() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_STALE_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        raise LockError(f"{LOCK_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0 or not math.isfinite(value):
        raise LockError(f"{LOCK_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name
    except IndexError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's live process
        return True
    try:  # a zombie (killed, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


@dataclass(frozen=True)
class LockInfo:
    """Who holds a lock: read from the lock file (``mtime`` is its last heartbeat)."""

    host: str
    boot_id: str
    pid: int
    pid_start: Optional[str]
    created: float
    token: str
    mtime: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        return f"pid {self.pid} on host {self.host} (since {when})"


def read_lock(path: str | os.PathLike) -> Optional[LockInfo]:
    """The lock file's content, or None when it is absent or not a complete fewclip lock."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return LockInfo(str(d["host"]), str(d.get("boot_id", "")), int(d["pid"]), d.get("pid_start"),
                        float(d["created"]), str(d["token"]), st.st_mtime)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunLock:
    """An exclusive lock on a folder: the file ``LOCK_FILE`` inside it (see the module docstring).

    ``try_acquire()`` never waits: True when held now, False when a live process holds it
    (``blocked_by`` then says who). ``release()`` removes the file if it is still ours. As a context
    manager it acquires (or raises :class:`RunLockedError`) and releases.
    """

    def __init__(self, folder: str | os.PathLike, *, stale_after_s: Optional[float] = None,
                 heartbeat_s: Optional[float] = None, name: str = LOCK_FILE):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.stale_after_s = float(stale_after_s) if stale_after_s is not None else default_stale_after()
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else max(0.5, min(60.0, self.stale_after_s / 5))
        self.token: Optional[str] = None
        self.blocked_by: Optional[LockInfo] = None
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    # -- state -------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self.token is not None

    def still_held(self) -> bool:
        """True when the lock file on disk is still this holder's (nobody broke it)."""
        info = read_lock(self.path)
        return self.token is not None and info is not None and info.token == self.token

    def is_stale(self, info: LockInfo) -> bool:
        same_host = info.host == socket.gethostname()
        same_boot = not info.boot_id or not _boot_id() or info.boot_id == _boot_id()
        if same_host and not same_boot:  # the host rebooted since: its processes are gone
            return True
        if same_host and os.name == "posix":  # (on Windows os.kill(pid, 0) would send a Ctrl-C: use the age)
            if info.pid == os.getpid():
                return False
            if not _pid_alive(info.pid):
                return True
            start = _process_start(info.pid)
            return bool(info.pid_start and start and start != info.pid_start)  # the pid was reused
        return time.time() - info.mtime > self.stale_after_s

    # -- acquire / release -------------------------------------------------
    def _create(self) -> bool:
        token = uuid.uuid4().hex
        info = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                "pid_start": _process_start(os.getpid()), "created": time.time(), "token": token}
        tmp = self.folder / f"{LOCK_FILE}.{token}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(info))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)  # atomic, fails if the lock exists; the file is complete when it appears
            except FileExistsError:
                pass
            except FileNotFoundError:  # the lock's holder tidied our temporary file away (remove_leftovers)
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                # A filesystem without hard links: O_EXCL creation (a reader may briefly see it empty).
                try:
                    fd2 = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd2, "w", encoding="utf-8") as f:
                    f.write(json.dumps(info))
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        mine = read_lock(self.path)  # a link reported failed on NFS may have succeeded, and vice versa
        if mine is not None and mine.token == token:
            self.token = token
            return True
        return False

    def _break(self, info: Optional[LockInfo]) -> None:
        """Remove the stale lock ``info`` (None: a damaged lock file); if it was replaced by a fresh lock
        since it was judged, put that one back."""
        aside = self.folder / f"{LOCK_FILE}.{uuid.uuid4().hex}.broken"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = read_lock(aside)
        if moved is not None and (info is None or moved.token != info.token):  # a fresh lock: restore it
            try:
                os.link(aside, self.path)
            except OSError:
                pass
        elif info is not None:
            log.warning("%s: removed a stale lock of %s (the process is gone)", self.folder, info.describe())
        else:
            log.warning("%s: removed a damaged lock file, untouched for over %g s", self.folder, self.stale_after_s)
        try:
            os.unlink(aside)
        except FileNotFoundError:
            pass

    def try_acquire(self) -> bool:
        if self.held:
            return True
        self.blocked_by = None
        for _ in range(5):
            if self._create():
                self._start_heartbeat()
                return True
            info = read_lock(self.path)
            if info is None:
                try:  # being created by someone else, or a damaged lock file: judge it by its age
                    age = time.time() - os.stat(self.path).st_mtime
                except FileNotFoundError:
                    continue
                if age > self.stale_after_s:
                    self._break(None)
                    continue
                time.sleep(0.05)
                continue
            if self.is_stale(info):
                self._break(info)
                continue
            self.blocked_by = info
            return False
        return False

    def acquire(self, timeout: Optional[float] = None, poll_s: float = 0.5) -> bool:
        """Wait until the lock is held (True) or ``timeout`` seconds have passed (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.try_acquire():
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(poll_s)
        return True

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join()
        self._beat = None
        if self.token is not None and self.still_held():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.token = None

    def __enter__(self) -> RunLock:
        if not self.try_acquire():
            raise locked_error(self.folder, self.blocked_by)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- heartbeat ---------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name=f"fewclip-lock {self.folder}", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if self.still_held():
                    os.utime(self.path)
            except OSError:
                pass


def locked_error(folder: Path, info: Optional[LockInfo]) -> RunLockedError:
    who = info.describe() if info else "another process"
    return RunLockedError(f"{folder} is being written by {who}; wait for it to finish or use another out=. "
                          f"(A lock of a process that is gone is removed automatically: on this host at once, "
                          f"from another host after {LOCK_TIMEOUT_ENV} seconds without a heartbeat.)")


